"""Twenty questions as a CrewAI flow: ``task.agent=tasks.q20.crewai_agent:q20_crewai_agent``.

The same game, prompts and reward as ``tasks/q20/agent.py`` (the stock ``openai`` version), written
the way the seed (agent-lightning's Tinker ``q20`` example) writes it: a CrewAI ``Flow`` whose state
is the game, a ``@start`` step where the player asks, a ``@router`` that referees, and a step where
the answerer replies. Both models are CrewAI's own ``LLM`` on the route's ``base_url``: the player is
the policy (``llm.model``), the answerer a frozen helper (``answerer``, default ``base``), so every
call is recorded with its exact token ids and the answerer's carry no loss.

Where it differs from the seed: the player is ``LLM.call`` on the growing conversation, not a
CrewAI ``Agent``/``Task`` per turn. An ``Agent`` wraps each turn in its own role/goal/ReAct prompt
and "Final Answer:" parsing, so turn after turn would be unrelated prompts: no one training
sequence, and nothing a 135M model could follow. ``LLM.call`` sends the game's messages as they are,
so the player's turns extend each other exactly and merge into one sample, as in the openai version.
One exception: a reply with text before a ``search`` call. CrewAI's ``LLM.call`` returns only the
calls, so that text never reaches the conversation, and the turns after it start a second sample
(tests/test_q20_crewai.py pins this).

Needs ``pip install -e '.[crewai]'``: CrewAI pins ``openai<3`` and ``pydantic<2.13`` (a venv of its
own: ``make test-crewai``).
"""

from __future__ import annotations

import os
from typing import Any

# CrewAI posts telemetry to its own server and may ask on the terminal whether to upload traces:
# neither belongs in a training run (set them to something else first to opt back in).
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

from crewai import LLM  # noqa: E402
from crewai.flow.flow import Flow, listen, router, start  # noqa: E402
from pydantic import BaseModel  # noqa: E402

import agl  # noqa: E402
from tasks.q20.agent import ANSWERER, FIRST, SEARCH_TOOL, SYSTEM, guessed, is_secret, search, search_query, verdict  # noqa: E402


class Game(BaseModel):
    """The flow's state: the secret, the player's conversation, and the score."""

    answer: str = ""
    category: str = ""
    messages: list[dict] = []
    question: str = ""  # the player's latest question, for the answerer
    questions: int = 0
    won: bool = False


class TwentyQuestions(Flow[Game]):
    """One game. ``player`` and ``answerer`` are CrewAI LLMs; ``search_tool`` offers ``search``."""

    player: Any = None
    answerer: Any = None
    max_turns: int = 20
    search_tool: bool = False
    suppress_flow_events: bool = True  # no console panel per step (32 games run at once)

    @start("next_question")
    def ask(self) -> None:
        """The player's turn: a question, or a search (its result goes back, and it counts as a question)."""
        state = self.state
        reply = self.player.call(state.messages, tools=[SEARCH_TOOL] if self.search_tool else None)
        state.questions += 1
        if isinstance(reply, list):  # tool calls: CrewAI hands them back when it is given no functions to run
            state.messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [call.model_dump(exclude_none=True) for call in reply],
                }
            )
            for call in reply:
                state.messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": search(search_query(call.function.arguments))}
                )
            state.question = ""
            return
        state.question = str(reply)
        state.messages.append({"role": "assistant", "content": state.question})

    @router(ask)
    def referee(self) -> str:
        """A right guess wins; a wrong one hears "No." from the game; any other question goes to the answerer."""
        state = self.state
        guess = guessed(state.question) if state.question else None
        if guess is not None and is_secret(guess, state.answer):
            state.won = True
            return "game_over"
        if guess is not None:
            state.messages.append({"role": "user", "content": "No."})
        elif state.question:
            return "to_answerer"
        return "next_question" if state.questions < self.max_turns else "game_over"

    @listen("to_answerer")
    def answer_question(self) -> None:
        state = self.state
        system = ANSWERER.format(answer=state.answer, category=state.category)
        reply = self.answerer.call([{"role": "system", "content": system}, {"role": "user", "content": state.question}])
        state.messages.append({"role": "user", "content": verdict(str(reply))})

    @router(answer_question)
    def next_turn(self) -> str:
        return "next_question" if self.state.questions < self.max_turns else "game_over"


def crewai_llm(llm: agl.LLM, model: str, **settings: Any) -> LLM:
    """CrewAI's LLM on the route: ``openai/<model>`` with a ``base_url`` is its native OpenAI client."""
    return LLM(model=f"openai/{model}", base_url=llm.base_url, api_key=llm.api_key, **settings)


def play(
    task: dict,
    llm: agl.LLM,
    prompt_template: str = SYSTEM,
    max_turns: int = 20,
    answerer: str = "base",
    search_tool: bool = False,
) -> Game:
    """Play one game; its final state (``won``, ``questions``, the player's ``messages``)."""
    messages = [
        {"role": "system", "content": prompt_template.format(category=task["category"])},
        {"role": "user", "content": FIRST},
    ]
    if max_turns < 1:
        return Game(answer=task["answer"], category=task["category"], messages=messages)
    game = TwentyQuestions(
        player=crewai_llm(llm, llm.model, **llm.sampling_parameters),
        answerer=crewai_llm(llm, answerer, max_tokens=3, temperature=0),  # greedy Yes or No, as in agent.py
        max_turns=max_turns,
        search_tool=search_tool,
        max_method_calls=max_turns + 1,  # CrewAI stops a step called more often than this (its loop guard)
    )
    game.kickoff(inputs={"answer": task["answer"], "category": task["category"], "messages": messages})
    return game.state


def q20_crewai_agent(
    task: dict,
    llm: agl.LLM,
    prompt_template: str = SYSTEM,
    max_turns: int = 20,
    answerer: str = "base",
    search_tool: bool = False,
    **_: object,
) -> float:
    """The agent (``task.agent``): reward 1 when the player names the secret within ``max_turns`` questions."""
    game = play(task, llm, prompt_template, max_turns, answerer, search_tool)
    agl.emit_metric("questions", float(game.questions))
    return 1.0 if game.won else 0.0
