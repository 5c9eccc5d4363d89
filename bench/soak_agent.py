"""The soak's agent (bench/soak.py): multi-turn chat with a tool, through the route, as a user would write it.

Each rollout's row says what it does: ``turns`` calls, the first one with the ``add`` tool (``tool_choice``
"required" on some rows), a tool result or a user turn after each reply; ``fail`` rows raise after their
calls, ``hang`` rows sleep past the attempt's timeout (the runner times them out). Every call's latency,
seen from the agent, goes to ``LATENCIES`` (the soak drains it between rounds).
"""

from __future__ import annotations

import asyncio
import time

import openai

import agl

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}
LATENCIES: list[float] = []  # seconds per LLM call, appended by agents, drained by the soak


def load(split: str) -> list[dict]:
    """Rows of every kind, in a fixed mix: 1 in 16 fails, 1 in 32 hangs, 1 in 4 forces the tool."""
    rows = []
    for i in range(512):
        kind = "hang" if i % 32 == 7 else "fail" if i % 16 == 3 else "ok"
        rows.append({"id": f"{split}-{i}", "kind": kind, "turns": 1 + i % 3, "force_tool": i % 4 == 0})
    return rows


async def soak_agent(task: dict, llm: agl.LLM, max_tokens: int = 8, **_: object) -> float:
    async with openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=120) as client:
        messages: list[dict] = [{"role": "user", "content": f"Row {task['id']}: add 1 and 2, then say why."}]
        for turn in range(task["turns"]):
            tools = {"tools": [ADD], "tool_choice": "required" if task["force_tool"] else "auto"} if turn == 0 else {}
            started = time.perf_counter()
            reply = await client.chat.completions.create(
                model=llm.model, messages=messages, max_tokens=max_tokens, **tools
            )
            LATENCIES.append(time.perf_counter() - started)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "3"})
            if not message.tool_calls:
                messages.append({"role": "user", "content": "Go on."})
    if task["kind"] == "fail":
        raise RuntimeError("a planned failure (the soak's agents fail 1 row in 16)")
    if task["kind"] == "hang":
        await asyncio.sleep(3600)  # the attempt's timeout ends it
    return float(len(messages))
