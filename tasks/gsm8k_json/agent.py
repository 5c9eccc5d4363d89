"""GSM8K through structure: the agent asks for ``{"reasoning": str, "answer": int}`` with a strict
``response_format``, so every reply that ends is well formed by construction (the route's grammar,
docs/structured-outputs.md) and the reward measures content only: 1 when ``answer`` equals the gold
number, else 0. A reply cut by ``max_tokens`` (finish_reason "length") is not JSON and earns 0.

The data are tasks/gsm8k's; the SFT warm-up's demonstrations are its gold solutions written as
this JSON. GRPO trains on the masked log-probs the sampler recorded (agl.train.grpo).
"""

from __future__ import annotations

import json

import openai

import agl
from tasks.gsm8k.data import load_split, solution_text
from tasks.gsm8k.scoring import numbers_equal


def answer_schema(reasoning_max_chars: int) -> dict:
    """The reply's JSON schema: the reasoning (bounded, so a reply always ends), then the integer answer
    (every GSM8K gold is an integer)."""
    return {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string", "maxLength": reasoning_max_chars},
            "answer": {"type": "integer"},
        },
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    }


def parse(text: str | None) -> dict | None:
    """The reply as a dict, or None when it is not a complete JSON object (cut by max_tokens)."""
    try:
        value = json.loads(text or "")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def gsm8k_json_agent(task: dict, llm: agl.LLM, prompt_template: str, reasoning_max_chars: int = 1200, **_) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": answer_schema(reasoning_max_chars), "strict": True},
        },
        **llm.sampling_parameters,
    )
    parsed = parse(reply.choices[0].message.content)
    correct = parsed is not None and numbers_equal(str(parsed["answer"]), task["gold"])
    agl.emit_metric("correct", float(correct))
    agl.emit_metric("complete", float(parsed is not None))  # ended by the grammar, not cut by max_tokens
    return float(correct)


def load(split: str) -> list[dict]:
    return load_split(split)


def demonstration(row: dict) -> str:
    """A gold solution as the JSON reply: its reasoning (the ``#### N`` line dropped) and the answer.

    >>> demonstration({"answer": "Half is 48/2 = <<48/2=24>>24.\\n#### 24", "gold": "24"})
    '{"reasoning": "Half is 48/2 = 24.", "answer": 24}'
    """
    reasoning = solution_text(row).rsplit("####", 1)[0].strip()
    return json.dumps({"reasoning": reasoning, "answer": int(row["gold"])}, ensure_ascii=False)


def demonstrations(split: str, prompt_template: str = "{question}") -> list[list[dict]]:
    """SFT conversations: the task's prompt as the user turn, the gold solution as JSON as the assistant turn."""
    return [
        [
            {"role": "user", "content": prompt_template.format(question=row["question"])},
            {"role": "assistant", "content": demonstration(row)},
        ]
        for row in load_split(split)
    ]
