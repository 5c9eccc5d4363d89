"""What an agent sees: an ``LLM`` endpoint, its task, its resources, and ``emit_reward``.

An agent is a plain function, sync or async::

    def my_agent(task: dict, llm: agl.LLM, prompt_template: str, **resources) -> float | None:
        client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
        reply = client.chat.completions.create(model=llm.model, messages=[...], **llm.sampling_parameters)
        return 1.0 if "Paris" in reply.choices[0].message.content else 0.0

A returned float is the rollout's final reward; ``emit_reward(value)`` records rewards during
the rollout (the last one counts when nothing is returned). An exception fails the attempt.
"""
from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import time
from typing import Any, Awaitable, Callable

from agl.types import Span


@dataclasses.dataclass(frozen=True)
class LLM:
    """The policy endpoint for one rollout attempt (agent-lightning's ``LLM`` resource)."""

    base_url: str
    model: str
    api_key: str = "agl"
    sampling_parameters: dict = dataclasses.field(default_factory=dict)  # e.g. temperature, max_tokens


@dataclasses.dataclass
class RolloutContext:
    """Where ``emit_reward`` writes: the running attempt, its store, and the event loop."""

    store: Any
    rollout_id: str
    attempt_id: str
    loop: asyncio.AbstractEventLoop
    rewards: list[float] = dataclasses.field(default_factory=list)
    pending: list[Any] = dataclasses.field(default_factory=list)

    def record(self, name: str, attributes: dict) -> Awaitable[Span]:
        now = time.time()
        return self.store.add_span(Span(rollout_id=self.rollout_id, attempt_id=self.attempt_id, name=name, start_time=now, end_time=now, attributes=attributes))

    def record_reward(self, value: float, final: bool = False) -> Awaitable[Span]:
        self.rewards.append(value)
        return self.record("reward", {"reward": value, "final": final})


_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("agl_rollout", default=None)


def emit_reward(value: float) -> None:
    """Record a reward for the running rollout (works from sync and async agents)."""
    _write(lambda context: context.record_reward(float(value)), "emit_reward")


def emit_metric(name: str, value: float) -> None:
    """Record a named number for the running rollout (e.g. "correct"); eval tables average it."""
    _write(lambda context: context.record("metric", {"name": name, "value": float(value)}), "emit_metric")


def _write(make: Callable[[RolloutContext], Awaitable[Span]], caller: str) -> None:
    context = _current.get()
    if context is None:
        raise RuntimeError(f"{caller}() was called outside a rollout")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is context.loop:  # async agent: the runner awaits this before finishing
        context.pending.append(asyncio.ensure_future(make(context)))
    else:  # sync agent in a worker thread: write through the loop and wait for it
        asyncio.run_coroutine_threadsafe(make(context), context.loop).result()


def rollout(function: Callable) -> Callable:
    """Mark a function as an agent (agent-lightning's ``@rollout``). Optional: any function works."""
    function.__agl_agent__ = True
    return function


async def call_agent(agent: Callable, context: RolloutContext, task: Any, llm: LLM, resources: dict, executor: Any = None) -> Any:
    """Run a sync agent in a worker thread or await an async one, with ``context`` current."""
    token = _current.set(context)
    try:
        if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None)):
            result = await agent(task, llm, **resources)
        else:
            # copy_context carries the current rollout into the thread for emit_reward
            run = functools.partial(contextvars.copy_context().run, agent, task, llm, **resources)
            result = await asyncio.get_running_loop().run_in_executor(executor, run)
        if context.pending:
            await asyncio.gather(*context.pending)
        return result
    finally:
        _current.reset(token)
