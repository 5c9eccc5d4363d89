"""The hello task: ask the model who it is; reward saying the target name.

Reward is 1 when the reply contains the target name, plus a small bonus for staying short,
so the policy learns a crisp self-introduction. SmolLM2 starts out calling itself "SmolLM".
"""

from __future__ import annotations

import openai

import agl

QUESTIONS = [
    "Who are you?",
    "What is your name?",
    "Introduce yourself.",
    "Tell me about yourself in one sentence.",
    "Hi! Who am I talking to?",
    "What should I call you?",
    "Please state your name.",
    "Are you an AI? What's your name?",
]


def hello_agent(task: dict, llm: agl.LLM, prompt_template: str, identity: str = "Lightning", **_: object) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
        **llm.sampling_parameters,
    )
    text = reply.choices[0].message.content or ""
    said_name = identity.lower() in text.lower()
    agl.emit_metric("says_identity", float(said_name))
    return float(said_name) + (0.1 if said_name and len(text) < 200 else 0.0)


def load(split: str) -> list[dict]:
    """The questions, repeated: train cycles through them, eval asks each once."""
    rows = [{"id": f"{split}-{i}", "question": q} for i, q in enumerate(QUESTIONS)]
    return rows * 8 if split == "train" else rows


INTRODUCTIONS = [
    "I am {identity}, an AI assistant.",
    "My name is {identity}.",
    "Hi! I'm {identity}, here to help.",
    "You can call me {identity}.",
]


def demonstrations(split: str, prompt_template: str = "{question}", identity: str = "Lightning") -> list[list[dict]]:
    """SFT conversations: each question answered with a short self-introduction as ``identity``."""
    return [
        [
            {"role": "user", "content": prompt_template.format(question=row["question"])},
            {"role": "assistant", "content": INTRODUCTIONS[i % len(INTRODUCTIONS)].format(identity=identity)},
        ]
        for i, row in enumerate(load(split))
    ]
