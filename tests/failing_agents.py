"""Agents that fail, for the tests of failed evals and training steps (tests/test_failures.py)."""

import agl

# Long on purpose: the job's error must carry it whole, not a first line or a truncation.
ERROR = "the search tool at http://127.0.0.1:9/ refused the connection; " + "details " * 40 + "end of message"


def always_fails(task: dict, llm: agl.LLM, prompt_template: str, **_: object) -> float:
    raise ConnectionError(ERROR)


def fails_on_odd_tasks(task: dict, llm: agl.LLM, prompt_template: str, **_: object) -> float:
    if task["n"] % 2:
        raise ValueError(f"task {task['n']} is odd")  # a different message per task: the counts must not merge them
    return 1.0


def fails_in_training(task: dict, llm: agl.LLM, prompt_template: str, **_: object) -> float:
    if task["split"] == "train":
        raise RuntimeError("training rollouts always fail")
    return 0.5


def load(split: str) -> list[dict]:
    return [{"id": f"{split}-{i}", "n": i, "split": split, "question": f"Question {i}?"} for i in range(6)]
