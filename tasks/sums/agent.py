"""The sums task: "What is 17 + 25?"; the reward is 1 when the reply is the sum and nothing else.

Why this task is the first run (``make demo``): its problems are many, short and cheap (a 40-token prompt, a reply of a
few tokens), so a greedy eval of 200 of them takes seconds, and the reward is 0/1, so the eval before and after
training is a paired test with real power. SmolLM2-135M-Instruct mostly knows these sums but rarely replies with the
number alone ("17 + 25 = 42", "The answer is 42."): a few SFT steps on bare answers and a few GRPO steps take it there,
which is learning a 200-problem McNemar test can see (RESULTS.md "Sums: the first run").

Metrics besides the reward: ``correct`` (the reply is the sum alone: the reward), ``number_only`` (the reply is one
integer, right or wrong) and ``sum_in_reply`` (the sum appears among the reply's numbers: what the model knows, with
the format aside).
"""

from __future__ import annotations

import random
import re

import openai

import agl

LARGEST = 30  # addends 1..LARGEST: 900 problems
TEST_SIZE = 200


def sums_agent(task: dict, llm: agl.LLM, prompt_template: str, format_bonus: float = 0.0, **_: object) -> float:
    """Reward 1 for the sum alone; ``format_bonus`` (``task.resources.format_bonus``) for a lone number that is not
    the sum, as GSM8K's well-formed wrong answer gets its own (partial credit for the form)."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
        **llm.sampling_parameters,
    )
    text = reply.choices[0].message.content or ""
    answer = bare_answer(text)
    agl.emit_metric("correct", float(answer == str(task["answer"])))
    agl.emit_metric("number_only", float(answer is not None))
    agl.emit_metric("sum_in_reply", float(str(task["answer"]) in re.findall(r"-?\d+", text)))
    return reward(text, task["answer"], format_bonus)


def reward(text: str, answer: int, format_bonus: float = 0.0) -> float:
    """1 for the sum alone, ``format_bonus`` for another lone number, else 0.

    >>> reward("42", 42), reward("41", 42), reward("41", 42, format_bonus=0.1), reward("17 + 25 = 42", 42, 0.1)
    (1.0, 0.0, 0.1, 0.0)
    """
    bare = bare_answer(text)
    return 1.0 if bare == str(answer) else format_bonus if bare is not None else 0.0


def bare_answer(text: str) -> str | None:
    """The reply's number when the reply is one integer and nothing else (a final period allowed), else None.

    >>> bare_answer(" 42.\\n"), bare_answer("42"), bare_answer("The sum is 42."), bare_answer("17 + 25 = 42")
    ('42', '42', None, None)
    """
    stripped = text.strip().removesuffix(".").strip()
    return stripped if re.fullmatch(r"-?\d+", stripped) else None


def load(split: str) -> list[dict]:
    """Every pair of addends in 1..LARGEST, shuffled once (seed 0): the first TEST_SIZE are the test split."""
    pairs = [(a, b) for a in range(1, LARGEST + 1) for b in range(1, LARGEST + 1)]
    random.Random(0).shuffle(pairs)
    if split not in ("train", "test"):
        raise ValueError(f"task sums has splits train and test, not {split!r}")
    chosen = pairs[:TEST_SIZE] if split == "test" else pairs[TEST_SIZE:]
    return [{"id": f"{split}-{a}+{b}", "question": f"What is {a} + {b}?", "answer": a + b} for a, b in chosen]


def demonstrations(split: str, prompt_template: str = "{question}") -> list[list[dict]]:
    """SFT conversations: the task's prompt, and the sum alone as the reply."""
    return [
        [
            {"role": "user", "content": prompt_template.format(question=row["question"])},
            {"role": "assistant", "content": str(row["answer"])},
        ]
        for row in load(split)
    ]
