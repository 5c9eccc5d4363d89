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
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from agl.config import NO_API_KEY
from agl.types import Span

if TYPE_CHECKING:
    from agl.store import SqliteStore, StoreClient

log = logging.getLogger(__name__)

REWARD_SPAN = "reward"  # what emit_reward (and a returned reward) records; final_reward reads it back
METRIC_SPAN = "metric"  # what emit_metric records


@dataclasses.dataclass(frozen=True)
class LLM:
    """The policy endpoint for one rollout attempt (agent-lightning's ``LLM`` resource)."""

    base_url: str
    model: str
    api_key: str = NO_API_KEY
    sampling_parameters: dict = dataclasses.field(default_factory=dict)  # e.g. temperature, max_tokens


@dataclasses.dataclass
class RolloutContext:
    """Where ``emit_reward`` writes: the running attempt, its store, and the event loop."""

    store: SqliteStore | StoreClient
    rollout_id: str
    attempt_id: str
    loop: asyncio.AbstractEventLoop
    pending: list[Any] = dataclasses.field(default_factory=list)

    def record(self, name: str, attributes: dict) -> Awaitable[Span]:
        now = time.time()
        return self.store.add_span(
            Span(
                rollout_id=self.rollout_id,
                attempt_id=self.attempt_id,
                name=name,
                start_time=now,
                end_time=now,
                attributes=attributes,
            )
        )

    def record_reward(self, value: float, final: bool = False) -> Awaitable[Span]:
        return self.record(REWARD_SPAN, {"reward": value, "final": final})


def final_reward(spans: Iterable[Span]) -> float | None:
    """The rollout's reward: the last reward span's value (a returned reward is recorded last)."""
    rewards = [s for s in spans if s.name == REWARD_SPAN and s.attributes.get("reward") is not None]
    if not rewards:
        return None
    return float(max(rewards, key=lambda s: s.sequence_id or 0).attributes["reward"])


_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("agl_rollout", default=None)


def emit_reward(value: float) -> None:
    """Record a reward for the running rollout (works from sync and async agents)."""
    _write(lambda context: context.record_reward(float(value)), "emit_reward")


def emit_metric(name: str, value: float) -> None:
    """Record a named number for the running rollout (e.g. "correct"); eval tables average it."""
    _write(lambda context: context.record(METRIC_SPAN, {"name": name, "value": float(value)}), "emit_metric")


def _write(make: Callable[[RolloutContext], Awaitable[Span]], caller: str) -> None:
    context = _current.get()
    if context is None:
        raise RuntimeError(f"{caller}() was called outside a rollout")
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is context.loop:  # on the harness's loop (a hook): the runner awaits it before finishing
        context.pending.append(asyncio.ensure_future(make(context)))
    else:  # an agent in its worker thread (sync, or async on its own loop): write through the harness's loop
        asyncio.run_coroutine_threadsafe(make(context), context.loop).result()


class _OwnLoop:
    """An async agent's own event loop, in its worker thread; ``cancel()`` from any thread."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._cancelled = False

    def run(self, start: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``start()``'s coroutine to the end on a new loop (made here: never left un-awaited)."""

        async def main() -> Any:
            with self._lock:
                self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
                if self._cancelled:
                    self._task.cancel()
            return await _watched(start(), self.name)

        return asyncio.run(main())

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._loop is not None and self._task is not None:
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: nothing left to cancel
                    self._loop.call_soon_threadsafe(self._task.cancel)


async def _watched(coroutine: Awaitable[Any], name: str, period: float = 0.25) -> Any:
    """Await ``coroutine`` while a ticker on the same loop notices when something blocks it
    (also at the end: an agent that never awaits gives the ticker no chance to run)."""
    last_tick = time.monotonic()

    def check() -> None:
        nonlocal last_tick
        now = time.monotonic()
        stalled, last_tick = now - last_tick - period, now
        if stalled >= BLOCKED_WARNING_S:
            log.warning(
                "agent %s blocked its event loop for %.1f s: a blocking call inside an async agent "
                "(a sync client, time.sleep, ...). It slows only this agent; use an async client or asyncio.to_thread.",
                name,
                stalled,
            )

    async def tick() -> None:
        while True:
            await asyncio.sleep(period)
            check()

    ticker = asyncio.ensure_future(tick())
    try:
        return await coroutine
    finally:
        ticker.cancel()
        check()


def rollout(function: Callable) -> Callable:
    """agent-lightning's ``@rollout``, so its agents run unchanged. It marks nothing and changes
    nothing: any function (or callable object) taking ``(task, llm, ...)`` is an agent here."""
    return function


BLOCKED_WARNING_S = 1.0  # an async agent's loop stalled this long: say which agent, and why it matters


async def call_agent(
    agent: Callable, context: RolloutContext, task: Any, llm: LLM, resources: dict, executor: Executor | None = None
) -> Any:
    """Run the agent in a worker thread, with ``context`` current: a sync agent as it is, an async
    one on an event loop of its own in that thread.

    Why not await an async agent on the harness's loop: that loop also runs the route and the
    engine, and agents often make one blocking call (a sync ``openai`` client, ``litellm.completion``,
    LangChain's ``.invoke``, ``time.sleep``). On the shared loop that call froze the route, so the
    agent's own request could never be answered and every call timed out. On its own loop it
    slows only that agent, and a warning names it. One consequence: each attempt of an async agent
    runs on a new loop, so an async client cached across rollouts (a module-level ``AsyncOpenAI``)
    is bound to a closed loop; create clients inside the agent, as the examples do.
    """
    token = _current.set(context)
    own_loop = None
    try:
        if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None)):  # noqa: B004 (a callable object's __call__ may be async)
            own_loop = _OwnLoop(f"{getattr(agent, '__qualname__', agent)} (rollout {context.rollout_id})")
            target = functools.partial(own_loop.run, functools.partial(agent, task, llm, **resources))
        else:
            target = functools.partial(agent, task, llm, **resources)
        # copy_context carries the current rollout into the thread for emit_reward
        try:
            result = await asyncio.get_running_loop().run_in_executor(executor, contextvars.copy_context().run, target)
        except asyncio.CancelledError:  # timed out or shutting down: an async agent can be stopped, a thread cannot
            if own_loop is not None:
                own_loop.cancel()
            raise
        if context.pending:
            await asyncio.gather(*context.pending)
        return result
    finally:
        _current.reset(token)
