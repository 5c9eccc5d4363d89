"""Twenty questions: the policy asks yes/no questions about a secret noun and guesses it.

Seed: the Tinker + agent-lightning integration's ``q20`` example (a CrewAI flow there), written
here with the stock ``openai`` client. Per turn the player (the policy, ``llm.model``) asks one
question. A guess is a whole message of the form "Is it a <noun>?": one noun per question, so
listing nouns in one message wins nothing (the reward cannot be gamed that way). A wrong guess
hears "No." from the game itself; any other question goes to the answerer, a frozen helper model
on the same route (``answerer``, default ``base``: the base model with the adapter off, recorded
as spans that carry no loss). Reward 1 when the player names the secret within ``max_turns``
questions, else 0.

With ``search: true`` the player also gets a mock ``search`` tool (called through tool calls)
that lists the nouns of a category it names; its calls do not count as questions.

Left out: the seed's second answerer prompt that may reply "maybe", and a real web search.
``tasks/q20/crewai_agent.py`` plays the same game as a CrewAI flow (``pip install -e '.[crewai]'``).
"""

from __future__ import annotations

import json
import random
import re

import openai

import agl
from tasks.q20.nouns import NOUNS

SYSTEM = (
    "Let's play twenty questions. I am thinking of something in the category: {category}. "
    "Ask me one yes-or-no question at a time "
    'to find out which one. When you want to guess, ask "Is it a ...?" naming one thing.'
)
FIRST = "Ask your first question."
ANSWERER = (
    'You are the host of a game of twenty questions. The secret is "{answer}", a {category}. '
    "Answer the player's question about it truthfully with one word: Yes or No."
)
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search an encyclopedia for a kind of thing; returns common examples.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
GUESS = re.compile(r"^\s*is it (?:an? |the )?([a-z]+)\s*\?*\s*$", re.IGNORECASE)


def guessed(question: str) -> str | None:
    """The noun a question guesses, if it is a guess.

    >>> guessed("Is it a penguin?"), guessed("is it an owl"), guessed("Is it an animal that flies?")
    ('penguin', 'owl', None)
    >>> guessed("Is it a cat or a dog?") is None, guessed("Is it a big cat?") is None
    (True, True)
    """
    match = GUESS.match(question)
    return None if match is None else match.group(1).lower()


def is_secret(guess: str, answer: str) -> bool:
    """A guess names the secret, singular or plural: ``is_secret("cats", "cat")`` is True."""
    return guess in (answer, answer + "s", answer + "es")


def search(query: str) -> str:
    """The mock search tool: examples of every category the query names."""
    hits = [
        f"Common {category}s: {', '.join(nouns)}."
        for category, nouns in NOUNS.items()
        if category.split()[-1] in query.lower()
    ]
    return " ".join(hits) or "No results."


def search_query(arguments: str | None) -> str:
    """The ``query`` of a search call's arguments (the model's own text: malformed JSON searches for nothing).

    >>> search_query('{"query": "birds"}'), search_query('{"query": "birds"}}'), search_query(None)
    ('birds', '', '')
    """
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return ""
    return str(parsed.get("query", "")) if isinstance(parsed, dict) else ""


def q20_agent(
    task: dict,
    llm: agl.LLM,
    prompt_template: str = SYSTEM,
    max_turns: int = 20,
    answerer: str = "base",
    search_tool: bool = False,
    **_: object,
) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    answer, category = task["answer"], task["category"]
    messages = [
        {"role": "system", "content": prompt_template.format(category=category)},
        {"role": "user", "content": FIRST},
    ]
    tools = {"tools": [SEARCH_TOOL]} if search_tool else {}
    questions = 0
    while questions < max_turns:
        message = (
            client.chat.completions.create(model=llm.model, messages=messages, **tools, **llm.sampling_parameters)
            .choices[0]
            .message
        )
        if message.tool_calls:  # a search: answered by the tool, not counted as a question
            messages.append(message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
            for call in message.tool_calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": search(search_query(call.function.arguments))}
                )
            questions += 1  # bounded all the same: a player that only searches still ends
            continue
        question = message.content or ""
        messages.append({"role": "assistant", "content": question})
        questions += 1
        guess = guessed(question)
        if guess is not None and is_secret(guess, answer):
            agl.emit_metric("questions", float(questions))
            return 1.0
        reply = "No." if guess is not None else ask_answerer(client, answerer, answer, category, question)
        messages.append({"role": "user", "content": reply})
    agl.emit_metric("questions", float(max_turns))
    return 0.0


def ask_answerer(client: openai.OpenAI, model: str, answer: str, category: str, question: str) -> str:
    """The frozen answerer's Yes or No (greedy; anything but a leading "yes" counts as No)."""
    reply = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": ANSWERER.format(answer=answer, category=category)},
            {"role": "user", "content": question},
        ],
        max_tokens=3,
        temperature=0,
    )
    return verdict(reply.choices[0].message.content or "")


def verdict(reply: str) -> str:
    """What the game tells the player from the answerer's reply: anything but a leading "yes" is No.

    >>> verdict(" Yes, it is."), verdict("yes"), verdict("Maybe"), verdict("")
    ('Yes.', 'Yes.', 'No.', 'No.')
    """
    return "Yes." if reply.strip().lower().startswith("yes") else "No."


def load(split: str) -> list[dict]:
    """Train: 12 nouns per category; test: the other 4 (every fourth), never seen in training."""
    held_out = split == "test"
    return [
        {"id": f"{category}-{noun}", "category": category, "answer": noun}
        for category, nouns in NOUNS.items()
        for i, noun in enumerate(nouns)
        if (i % 4 == 3) == held_out
    ]


def demonstrations(split: str, prompt_template: str = SYSTEM, max_turns: int = 20, **_: object) -> list[list[dict]]:
    """SFT games: guessing the category's train nouns in a shuffled order, one per question, until
    the secret. They teach the form of a guess and to enumerate the category; the test nouns
    never appear, so a gain on the test split means naming unseen members of a category."""
    rows = load(split)
    games = []
    for row in rows:
        rng = random.Random(row["id"])
        others = [r["answer"] for r in rows if r["category"] == row["category"] and r["answer"] != row["answer"]]
        rng.shuffle(others)
        order = others[: rng.randrange(min(len(others), max_turns - 1) + 1)] + [row["answer"]]
        messages = [
            {"role": "system", "content": prompt_template.format(category=row["category"])},
            {"role": "user", "content": FIRST},
        ]
        for noun in order:
            messages.append({"role": "assistant", "content": f"Is it {'an' if noun[0] in 'aeiou' else 'a'} {noun}?"})
            if noun != row["answer"]:
                messages.append({"role": "user", "content": "No."})
        games.append(messages)
    return games
