"""Guess the number: the agent guesses 1-100 and hears "too low" or "too high", up to N turns.

Every turn appends the model's reply and the game's answer to one conversation, so the
route's prompts extend each other and the adapter merges the turns into one training
sequence with only the model's tokens in the loss. Reward 1 on success, else 0, or with
``search_bonus`` (``task.resources.search_bonus``) partial credit for a lost game: that
times the share of the range's bits its guesses ruled out (``reward``). The metric ``won``
is the 0/1 success whatever the reward.
"""

from __future__ import annotations

import math
import random
import re

import openai

import agl

SYSTEM = (
    "You are playing a guessing game. I am thinking of a whole number from 1 to 100. "
    "Reply with a single number as your guess."
)


FIRST = "Make your first guess."


def feedback(guess: int, secret: int) -> str:
    return "Too low. Guess again." if guess < secret else "Too high. Guess again."


def guess_number_agent(
    task: dict,
    llm: agl.LLM,
    prompt_template: str = SYSTEM,
    max_turns: int = 6,
    search_bonus: float = 0.0,
    **_: object,
) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    secret = task["secret"]
    messages = [{"role": "system", "content": prompt_template}, {"role": "user", "content": FIRST}]
    guesses: list[int] = []
    for turn in range(max_turns):  # noqa: B007 (the turns played, after the loop)
        reply = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        match = re.search(r"-?\d+", text)
        if match is None:
            feedback_text = "That is not a number. Reply with a single number from 1 to 100."
        else:
            guesses.append(int(match.group()))
            if guesses[-1] == secret:
                break
            feedback_text = feedback(guesses[-1], secret)
        messages.append({"role": "user", "content": feedback_text})
    won = bool(guesses) and guesses[-1] == secret
    agl.emit_metric("turns", float(turn + 1))
    agl.emit_metric("won", float(won))
    return reward(guesses, secret, search_bonus)


def reward(guesses: list[int], secret: int, search_bonus: float = 0.0) -> float:
    """1 when the last guess is the secret; else ``search_bonus`` times the share of log2(100) bits the guesses ruled
    out: the feedback leaves the secret in [lo, hi], and a lost game scores ``search_bonus * log2(100 / (hi - lo + 1))
    / log2(100)``. Partial credit that binary search maximizes: a group of lost games rarely ties, so GRPO's groups
    stay informative where wins are rare (issue 52).

    >>> [round(reward(g, 37, 0.5), 3) for g in ([50, 25, 37], [50, 25], [50, 50, 50], [50, 25, 38])]
    [1.0, 0.155, 0.077, 0.23]
    >>> reward([50, 25], 37)  # no bonus: 0/1
    0.0
    """
    if guesses and guesses[-1] == secret:
        return 1.0
    lo, hi = 1, 100
    for guess in guesses:
        lo, hi = (max(lo, guess + 1), hi) if guess < secret else (lo, min(hi, guess - 1))
    return search_bonus * math.log2(100 / (hi - lo + 1)) / math.log2(100)


def load(split: str) -> list[dict]:
    rng = random.Random({"train": 0, "test": 1}.get(split, 2))
    size = 512 if split == "train" else 256  # test: 256 games, so a success rate's 95% interval is about +-6 points
    return [{"id": f"{split}-{i}", "secret": rng.randint(1, 100)} for i in range(size)]


def demonstrations(split: str, prompt_template: str = SYSTEM, max_turns: int = 6, **_: object) -> list[list[dict]]:
    """SFT conversations: binary search on the split's secrets, one bare number per turn, with the
    agent's own feedback. It finds the secret within 6 turns for 63 of the 100 numbers; a game it
    does not finish still shows the strategy, so it is kept."""
    games = []
    for row in load(split):
        lo, hi, secret = 1, 100, row["secret"]
        messages = [{"role": "system", "content": prompt_template}, {"role": "user", "content": FIRST}]
        for _turn in range(max_turns):
            guess = (lo + hi) // 2
            messages.append({"role": "assistant", "content": str(guess)})
            if guess == secret:
                break
            lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
            messages.append({"role": "user", "content": feedback(guess, secret)})
        if messages[-1]["role"] == "user":  # an unfinished game ends on the model's last guess
            messages.pop()
        games.append(messages)
    return games
