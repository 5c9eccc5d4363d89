"""Runners: asyncio workers that take rollouts from the store and run the agent on them.

For each dequeued attempt a runner builds the rollout-scoped ``LLM`` endpoint, calls the
hooks and the agent, and reports the outcome:

  - the agent returns (a float or None)  -> final reward span (if any), attempt ``succeeded``
  - the agent or a hook raises           -> attempt ``failed``; the traceback goes into the
                                            attempt's metadata
  - ``config.timeout_seconds`` passes    -> attempt ``timeout``

Retries then follow the store's rules (``RolloutConfig.retry_condition``/``max_attempts``).
A runner survives anything its agent does; only cancellation stops it.

The agent's ``llm.sampling_parameters`` are the rollout's ``metadata["sampling"]``, else the
runner's ``default_sampling`` (an algorithm's decoding for rollouts enqueued without their own).

A runner in another process than the route (``agl.agents.attach``) is given ``route_alive``, asked
before an attempt's outcome is reported: once the route's process has ended, an outcome says
nothing about the agent (its calls failed, or it made something of failed calls), so it is
not reported, and the attempt goes back to the queue uncharged when the runner's store
session closes (rule R7).

Hooks have agent-lightning's names and order: ``on_rollout_start``, ``on_trace_start``,
(agent runs), ``on_trace_end``, ``on_rollout_end``. ``on_rollout_end`` sees the attempt's
spans and may return a float, which replaces the rollout's final reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from agl.agents.api import LLM, RolloutContext, call_agent
from agl.config import NO_API_KEY
from agl.errors import DiskFull
from agl.store import SessionEnded, StoreUnreachable
from agl.types import AttemptedRollout, AttemptStatus, Span

if TYPE_CHECKING:
    from agl.store import SqliteStore, StoreClient

log = logging.getLogger(__name__)


class Hook:
    """Override any of these; each may be sync or async. A hook that raises fails the attempt."""

    def on_rollout_start(self, *, agent: Any, runner: Runner, rollout: AttemptedRollout) -> Any: ...

    def on_trace_start(self, *, agent: Any, runner: Runner, rollout: AttemptedRollout) -> Any: ...

    def on_trace_end(self, *, agent: Any, runner: Runner, rollout: AttemptedRollout) -> Any: ...

    def on_rollout_end(
        self, *, agent: Any, runner: Runner, rollout: AttemptedRollout, spans: list[Span]
    ) -> float | None: ...


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


class Runner:
    """One worker. ``llm_endpoint(rollout_id, attempt_id)`` gives the rollout-scoped base URL."""

    def __init__(
        self,
        store: SqliteStore | StoreClient,
        agent: Callable,
        llm_endpoint: Callable[[str, str], str],
        model_name: str,
        api_key: str = NO_API_KEY,
        default_sampling: dict | None = None,
        hooks: Sequence[Hook] = (),
        worker_id: str = "runner-0",
        poll_interval: float = 0.02,
        heartbeat_interval: float = 5.0,
        executor: Executor | None = None,
        route_alive: Callable[[], Awaitable[bool]] | None = None,
    ):
        self.store = store
        self.agent = agent
        self.llm_endpoint = llm_endpoint
        self.model_name = model_name
        self.api_key = api_key
        self.default_sampling = default_sampling or {}
        self.hooks = list(hooks)
        self.worker_id = worker_id
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self.executor = executor  # threads for sync agents: one per runner, so none waits for a thread
        self.route_alive = route_alive  # see the module docstring
        self._resources_cache: dict[str, dict] = {}

    async def run_forever(self) -> None:
        """Run rollouts until cancelled; a full disk ends this runner (the job stops on the same error), and so
        does a store joined by URL that is lost to it (its runner process joins again: agl.agents.attach)."""
        try:
            while True:
                if not await self.run_one():
                    await asyncio.sleep(self.poll_interval)
        except (DiskFull, StoreUnreachable, SessionEnded):
            return

    async def run_one(self) -> bool:
        """Dequeue and run one rollout; False when the queue was empty."""
        rollout = await self.store.dequeue_rollout(worker_id=self.worker_id)
        if rollout is None:
            return False
        await self.run_attempt(rollout)
        return True

    async def run_attempt(self, rollout: AttemptedRollout) -> AttemptStatus | None:
        """Run one attempt and report its status; None when the route's process ended meanwhile."""
        attempt = rollout.attempt
        heartbeat = asyncio.create_task(self._heartbeat(rollout))
        status, metadata = AttemptStatus.SUCCEEDED, None
        try:
            await asyncio.wait_for(self._run(rollout), timeout=rollout.config.timeout_seconds)
        except TimeoutError:
            status, metadata = AttemptStatus.TIMEOUT, {"error": f"timed out after {rollout.config.timeout_seconds}s"}
        except asyncio.CancelledError:
            raise  # shutting down: the store marks this session's attempts unresponsive on close
        except Exception as error:  # the agent's or a hook's fault, never the runner's end
            status = AttemptStatus.FAILED
            metadata = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        finally:
            heartbeat.cancel()
        if self.route_alive is not None and not await self.route_alive():
            return None
        await self.store.update_attempt(
            rollout.rollout_id, attempt.attempt_id, status=status, **({"metadata": metadata} if metadata else {})
        )
        return status

    async def _run(self, rollout: AttemptedRollout) -> None:
        attempt = rollout.attempt
        resources = await self._resources(rollout.resources_id)
        llm = LLM(
            base_url=self.llm_endpoint(rollout.rollout_id, attempt.attempt_id),
            model=self.model_name,
            api_key=self.api_key,
            sampling_parameters=dict((rollout.metadata or {}).get("sampling") or self.default_sampling),
        )
        context = RolloutContext(self.store, rollout.rollout_id, attempt.attempt_id, asyncio.get_running_loop())
        await self._call_hooks("on_rollout_start", rollout=rollout)
        await self._call_hooks("on_trace_start", rollout=rollout)
        result = await call_agent(self.agent, context, rollout.input, llm, resources, self.executor)
        await self._call_hooks("on_trace_end", rollout=rollout)
        final = None if result is None else float(result)
        if self.hooks:
            spans = await self.store.query_spans(rollout.rollout_id, attempt.attempt_id)
            for hook in self.hooks:
                adjusted = await _maybe_await(
                    hook.on_rollout_end(agent=self.agent, runner=self, rollout=rollout, spans=spans)
                )
                if adjusted is not None:
                    final = float(adjusted)
        if final is not None:
            await context.record_reward(final, final=True)

    async def _call_hooks(self, name: str, **kwargs: Any) -> None:
        for hook in self.hooks:
            await _maybe_await(getattr(hook, name)(agent=self.agent, runner=self, **kwargs))

    async def _resources(self, resources_id: str | None) -> dict:
        if resources_id is None:
            return {}
        if resources_id not in self._resources_cache:
            update = await self.store.get_resources_by_id(resources_id)
            self._resources_cache[resources_id] = dict(update.resources) if update else {}
        return self._resources_cache[resources_id]

    async def _heartbeat(self, rollout: AttemptedRollout) -> None:
        # a lost store ends the attempt's report too (run_forever); the heartbeats just stop
        with contextlib.suppress(asyncio.CancelledError, StoreUnreachable, SessionEnded):
            while True:
                await asyncio.sleep(self.heartbeat_interval)
                await self.store.update_attempt(
                    rollout.rollout_id, rollout.attempt.attempt_id, last_heartbeat_time=time.time()
                )


class RunnerPool:
    """``n`` runners as asyncio tasks; ``async with RunnerPool(...)`` starts and stops them.

    ``n`` may be 0 (a job whose rollouts only runner processes run, ``runner.processes``).
    ``wait_for_agents``: on exit, also wait until the agent calls still running in threads have
    returned (a thread cannot be interrupted). A runner process that hands its attempts back
    sets it, so that none of its agents' requests reaches the route after the hand-back: a span
    recorded then would revive the handed-back attempt (rule R3) with no runner left to finish it.
    """

    def __init__(self, n: int, wait_for_agents: bool = False, **runner_kwargs: Any):
        self.executor = ThreadPoolExecutor(max_workers=max(n, 1), thread_name_prefix="agl-agent")
        self.wait_for_agents = wait_for_agents
        self.runners = [Runner(worker_id=f"runner-{i}", executor=self.executor, **runner_kwargs) for i in range(n)]
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> RunnerPool:
        self._tasks = [asyncio.create_task(r.run_forever(), name=r.worker_id) for r in self.runners]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.wait_for_agents:
            await asyncio.to_thread(self.executor.shutdown, wait=True, cancel_futures=True)
        else:  # a sync agent still running (e.g. one that timed out) cannot be interrupted; don't wait for it
            self.executor.shutdown(wait=False, cancel_futures=True)
