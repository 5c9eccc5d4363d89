"""Runner processes that join a live run: ``python harness.py algo=runner attach=<run dir> runner.n=8``.

agent-lightning's distributed workflow ("run additional runner processes at any time; they
register with the store and start dequeuing tasks immediately"), on one machine: the run's
``store.sqlite`` takes writers from several processes (WAL), and the route is HTTP.

What the job's process publishes (``agl.runtime.Runtime``): run_info ``"runners"``, the route's
rollout URL, the model name and API key, the task's config, the algorithm's default decoding
and the job's store session; written once the route serves, withdrawn (set to null) first thing
when the job stops, however it stops. The job's own runners are made from the same entry
(``runner_pool``), so an attached runner runs an attempt as an in-process one does: the route
records the LLM spans, the runner the rewards, metrics and the attempt's status.

An attached runner registers its own store session, so the attempts it takes are its own
(rule R7), and runs ``runner.n`` runners until:
  * the run ends for it: the entry is withdrawn (the job ended), or the job's session closed or
    its process died (``kill -9``). Exit 0, saying which. Its attempts still in flight, whose
    outcome says nothing about the agent once the route is gone, are not reported
    (``Runner(route_alive=...)``) and go back to the queue uncharged when its session closes;
  * SIGINT or SIGTERM: it stops dequeuing, waits for its agents' calls in flight (a thread cannot
    be interrupted; see ``RunnerPool(wait_for_agents=True)``) and closes its session: its attempts
    go back to the queue uncharged (``harness_ended: closed``). Exit 0. A second signal ends it at
    once (the default action); the job's store watchdog then finds the process dead within
    ``session_check_interval`` (5 s) and hands its attempts back (``dead``), as for a ``kill -9``.

Left out: waiting for a job that has not published its entry yet (attaching then fails with a
clear message; a job publishes once its model has loaded), following a resumed run (the resumed
job serves a new route: attach again; a runner started by ``runner.processes`` is started again
with it), signal handling under ``agl.run`` in a notebook (the job runs in a worker thread, where
asyncio takes no signals), runners on another machine (SQLite's
WAL needs shared memory, so one machine and one local file; a store served over HTTP, as
agent-lightning's LightningStoreServer does, or Postgres would carry this across machines, the
route being HTTP already), and runner hooks (the job's own runners have none either).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agl.agents.runner import RunnerPool
from agl.agents.tasks import load_task
from agl.config import RunnerConfig, plain
from agl.errors import ConfigError
from agl.store import SqliteStore

RUNNERS_KEY = "runners"  # the run_info key of the published entry
POLL_S = 0.5  # how often an attached runner looks whether the run still runs


def runner_entry(rollout_url: str, model: str, api_key: str, session: str, task: Any, default_sampling: dict) -> dict:
    """What a runner needs to join the run. ``rollout_url`` has ``{rollout_id}`` and ``{attempt_id}`` fields."""
    return {
        "rollout_url": rollout_url,
        "model": model,
        "api_key": api_key,
        "session": session,
        "task": plain(task),
        "default_sampling": default_sampling,
    }


def runner_pool(n: int, store: SqliteStore, entry: dict, agent: Callable, **kwargs: Any) -> RunnerPool:
    """``n`` runners of the run ``entry`` describes, in its job's process or an attached one."""
    return RunnerPool(
        n,
        store=store,
        agent=agent,
        llm_endpoint=lambda rollout_id, attempt_id: entry["rollout_url"].format(
            rollout_id=rollout_id, attempt_id=attempt_id
        ),
        model_name=entry["model"],
        api_key=entry["api_key"],
        default_sampling=entry["default_sampling"],
        **kwargs,
    )


async def ended(store: SqliteStore, entry: dict) -> str | None:
    """Why the run ``entry`` describes is over for its runners, or None while it runs."""
    if await store.get_run_info(RUNNERS_KEY) != entry:
        return "the job stopped"
    if not await store.session_alive(entry["session"]):
        return "the job's process died"
    return None


async def attach(run: str | None, runner: RunnerConfig) -> dict:
    """The ``algo=runner`` job (see the module docstring): join the run dir ``run`` with ``runner.n`` runners."""
    if not run:
        raise ConfigError("algo=runner joins a running job: give its run dir, attach=<run dir>")
    if runner.n < 1:
        raise ConfigError(f"algo=runner runs runner.n rollouts at a time: runner.n must be at least 1, not {runner.n}")
    run_dir = Path(run)
    path = run_dir / "store.sqlite"
    if not path.is_file():
        raise ConfigError(f"attach='{run}' is not a run dir (no {path})")
    store = await SqliteStore.open(path)
    async with store:
        entry = await store.get_run_info(RUNNERS_KEY)
        if entry is None or await ended(store, entry):
            raise ConfigError(
                f"{run_dir} is not running: no job serves its route (a job publishes it once its model has loaded). "
                "Start or resume it, then attach."
            )
        task = load_task(entry["task"])
        loop = asyncio.get_running_loop()
        stopped: asyncio.Future[str] = loop.create_future()  # why this runner stops; the first reason counts

        def stop(why: str | None) -> None:
            if why and not stopped.done():
                stopped.set_result(why)

        async def route_alive() -> bool:
            why = await ended(store, entry)
            stop(why)
            return why is None

        def on_signal(signum: int) -> None:
            stop(f"{signal.Signals(signum).name}: its attempts in flight went back to the queue")
            for s in (signal.SIGINT, signal.SIGTERM):  # a second signal ends the process at once
                signal.signal(s, signal.SIG_DFL)

        if (
            threading.current_thread() is threading.main_thread()
        ):  # not so under agl.run in a notebook: no signals there
            for s in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(s, on_signal, s)
        print(f"attached to {run_dir} as store session {store.session_id}: {runner.n} runners", flush=True)
        async with runner_pool(runner.n, store, entry, task.agent, wait_for_agents=True, route_alive=route_alive):
            while not stopped.done():
                await asyncio.wait([stopped], timeout=POLL_S)
                await route_alive()
        session = store.session_id
    print(f"detached from {run_dir} (store session {session}): {stopped.result()}", flush=True)
    return {"run_dir": str(run_dir), "session": session, "ended": stopped.result()}
