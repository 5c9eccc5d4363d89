"""The GSM8K agent: one chat call, scored on its final `#### N` line (see scoring.py)."""

from __future__ import annotations

import openai

import agl
from tasks.gsm8k.data import load_split, solution_text
from tasks.gsm8k.scoring import answer_not_last, reward, score


def gsm8k_agent(task: dict, llm: agl.LLM, prompt_template: str, format_bonus: float = 0.1, **_: object) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
        **llm.sampling_parameters,
    )
    text = reply.choices[0].message.content or ""
    scored = score(text, task["gold"])
    agl.emit_metric("correct", float(scored["correct"]))
    agl.emit_metric("format", float(scored["format"]))
    agl.emit_metric("answer_not_last", float(answer_not_last(text)))  # the reward-hacking signature
    agl.emit_metric("correct_lenient", float(score(text, task["gold"], strict=False)["correct"]))
    return reward(text, task["gold"], format_bonus=format_bonus)


def load(split: str) -> list[dict]:
    return load_split(split)


def demonstrations(split: str, prompt_template: str = "{question}") -> list[list[dict]]:
    """SFT conversations: the task's prompt as the user turn, the gold solution (ending in
    ``#### N``, calculator annotations stripped) as the assistant turn."""
    return [
        [
            {"role": "user", "content": prompt_template.format(question=row["question"])},
            {"role": "assistant", "content": solution_text(row)},
        ]
        for row in load_split(split)
    ]
