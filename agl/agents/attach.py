"""Runner processes that join a live run, on this machine or any other:

    python harness.py algo=runner attach=<run dir> runner.n=8                 # this machine: the run dir's store
    python harness.py algo=runner store.url=http://<host>:4747 runner.n=8     # any host: a store served over HTTP

agent-lightning's distributed workflow ("run additional runner processes at any time; they
register with the store and start dequeuing tasks immediately"). On one machine the run's
``store.sqlite`` takes writers from several processes (WAL); from any host, a store served by
``algo=store`` (agl/store/server.py) does, through ``agl.StoreClient``. The route is HTTP either way.

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

Joined by URL (``store.url``, ``join``), a runner process needs no file of the run: its store
session is a client's, alive while it heartbeats (agl/store/sessions.py). It waits for a job to
publish its entry, and ``algo.route_url`` replaces the published route's address with the one this
host reaches. When what it reports may not count, it gives its session up and joins again as a new
one: when a request to the store failed after it was sent, a heartbeat could not reach the store
(a cut connection: its agents' calls to the route went the same way), or the store ended its session
for want of heartbeats. Its attempts in flight go back to the queue uncharged, when it closes the
session or when the store's deadline (``store.session_timeout``) ends it, and none of their outcomes is
reported. So a runner host that dies, is cut off or restarts costs no rollout and no retry.

Left out: waiting for a job that has not published its entry yet when attaching by run dir (it then
fails with a clear message; a job publishes once its model has loaded), following a resumed run (the
resumed job serves a new route: attach again; a runner started by ``runner.processes`` is started again
with it), signal handling under ``agl.run`` in a notebook (the job runs in a worker thread, where
asyncio takes no signals), and runner hooks (the job's own runners have none either). Joined by URL,
a cut between a runner and the route alone (the store still reached) is seen by its agents as failed
calls, as any network error of an agent's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from agl.agents.runner import RunnerPool
from agl.agents.tasks import load_task
from agl.config import RunnerConfig, StoreConfig, TaskConfig, plain
from agl.errors import ConfigError
from agl.store import SessionEnded, SqliteStore, StoreClient, StoreUnreachable

RUNNERS_KEY = "runners"  # the run_info key of the published entry
POLL_S = 0.5  # how often an attached runner looks whether the run still runs
LOST = (StoreUnreachable, SessionEnded)  # a joined runner's store is gone for it: what it reports may not count


def runner_entry(
    rollout_url: str, model: str, api_key: str, session: str, task: TaskConfig, default_sampling: dict
) -> dict:
    """What a runner needs to join the run. ``rollout_url`` has ``{rollout_id}`` and ``{attempt_id}`` fields."""
    return {
        "rollout_url": rollout_url,
        "model": model,
        "api_key": api_key,
        "session": session,
        "task": plain(task),
        "default_sampling": default_sampling,
    }


def runner_pool(n: int, store: SqliteStore | StoreClient, entry: dict, agent: Callable, **kwargs: Any) -> RunnerPool:
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


async def ended(store: SqliteStore | StoreClient, entry: dict) -> str | None:
    """Why the run ``entry`` describes is over for its runners, or None while it runs."""
    if await store.get_run_info(RUNNERS_KEY) != entry:
        return "the job stopped"
    if not await store.session_alive(entry["session"]):
        return "the job's process died"
    return None


def _stopper(signals: bool) -> tuple[asyncio.Future, Callable[[str | None], None]]:
    """A future of why this runner process stops (the first reason counts), set by ``stop`` or a signal."""
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[str] = loop.create_future()

    def stop(why: str | None) -> None:
        if why and not stopped.done():
            stopped.set_result(why)

    def on_signal(signum: int) -> None:
        stop(f"{signal.Signals(signum).name}: its attempts in flight went back to the queue")
        for s in (signal.SIGINT, signal.SIGTERM):  # a second signal ends the process at once
            signal.signal(s, signal.SIG_DFL)

    if signals and threading.current_thread() is threading.main_thread():  # not under agl.run in a notebook
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, on_signal, s)
    return stopped, stop


async def _run_runners(
    store: SqliteStore | StoreClient,
    entry: dict,
    runner: RunnerConfig,
    stopped: asyncio.Future,
    alive: Callable[[], Awaitable[bool]],
) -> None:
    """``runner.n`` runners of ``entry`` on ``store`` until ``stopped`` is set or ``alive()`` says no more."""
    task = load_task(entry["task"])
    async with runner_pool(runner.n, store, entry, task.agent, wait_for_agents=True, route_alive=alive):
        while not stopped.done() and await alive():
            await asyncio.wait([stopped], timeout=POLL_S)


def _check_runners(runner: RunnerConfig) -> None:
    if runner.n < 1:
        raise ConfigError(f"algo=runner runs runner.n rollouts at a time: runner.n must be at least 1, not {runner.n}")


async def attach(
    run: str | None,
    runner: RunnerConfig,
    store: StoreConfig | None = None,
    route_url: str | None = None,
    signals: bool = True,
) -> dict:
    """The ``algo=runner`` job (see the module docstring): join the run dir ``run`` with ``runner.n`` runners,
    or, with ``store.url``, the job whose store that server serves (``join``)."""
    if store is not None and store.url:
        if run:
            raise ConfigError("algo=runner joins by attach=<run dir> or by store.url=<url>, not both")
        return await join(store.url, store.api_key, runner, route_url=route_url, signals=signals)
    if not run:
        raise ConfigError(
            "algo=runner joins a running job: give its run dir, attach=<run dir>, or its store's URL, store.url=<url>"
        )
    _check_runners(runner)
    run_dir = Path(run)
    path = run_dir / "store.sqlite"
    if not path.is_file():
        raise ConfigError(f"attach='{run}' is not a run dir (no {path})")
    local = await SqliteStore.open(path)
    async with local:
        entry = await local.get_run_info(RUNNERS_KEY)
        if entry is None or await ended(local, entry):
            raise ConfigError(
                f"{run_dir} is not running: no job serves its route (a job publishes it once its model has loaded). "
                "Start or resume it, then attach."
            )
        stopped, stop = _stopper(signals)

        async def route_alive() -> bool:
            why = await ended(local, entry)
            stop(why)
            return why is None

        print(f"attached to {run_dir} as store session {local.session_id}: {runner.n} runners", flush=True)
        await _run_runners(local, entry, runner, stopped, route_alive)
        session = local.session_id
    print(f"detached from {run_dir} (store session {session}): {stopped.result()}", flush=True)
    return {"run_dir": str(run_dir), "session": session, "ended": stopped.result()}


def with_route(entry: dict, route_url: str | None) -> dict:
    """``entry`` with its route at ``route_url`` (scheme and address; the path is the job's)."""
    if not route_url:
        return entry
    given, published = urlsplit(route_url), urlsplit(entry["rollout_url"])
    if not given.scheme or not given.netloc:
        raise ConfigError(f"algo.route_url={route_url} should look like http://<host>:<port>")
    return {**entry, "rollout_url": urlunsplit((given.scheme, given.netloc, published.path, "", ""))}


async def _published(store: StoreClient, stopped: asyncio.Future, url: str) -> dict | None:
    """The entry of a running job, waited for (a job publishes it once its model has loaded); None if stopped."""
    told = False
    while not stopped.done():
        entry = await store.get_run_info(RUNNERS_KEY)
        if entry is not None and not await ended(store, entry):
            return entry
        if not told:
            print(f"waiting for a job to publish its route in the store at {url}", flush=True)
            told = True
        await asyncio.wait([stopped], timeout=POLL_S)
    return None


async def join(
    url: str, api_key: str | None, runner: RunnerConfig, route_url: str | None = None, signals: bool = True
) -> dict:
    """``algo=runner store.url=<url>``: ``runner.n`` runners of the job whose store ``url`` serves, as store
    sessions that join again when what they report may not count (see the module docstring)."""
    _check_runners(runner)
    stopped, stop = _stopper(signals)
    sessions: list[str] = []
    joined: dict | None = None  # the job's entry, as published
    while not stopped.done():
        client = StoreClient(url, api_key)
        try:
            try:
                await client.open()
            except StoreUnreachable as error:
                if joined is None:
                    raise ConfigError(
                        f"cannot reach the store at {url}: is it served (algo=store)? ({error})"
                    ) from None
                stop(f"the store at {url} could not be reached again")
                break
            if joined is None:
                entry = await _published(client, stopped, url)
                if entry is None:
                    break
            else:  # joining again: the same job, still running, or this runner process is done
                entry = await client.get_run_info(RUNNERS_KEY)
                why = "the job stopped" if entry != joined else await ended(client, entry)
                if why:
                    stop(why)
                    break
            joined = entry
            sessions.append(client.session_id)
            disconnects = client.disconnects

            async def alive(client: StoreClient = client, entry: dict = entry, disconnects: int = disconnects) -> bool:
                if client.broken or client.disconnects != disconnects:
                    return False  # what it reports may not count: give the session up (below)
                try:
                    why = await ended(client, entry)
                except LOST:
                    return False
                stop(why)
                return why is None

            print(f"joined the job at {url} as store session {client.session_id}: {runner.n} runners", flush=True)
            await _run_runners(client, with_route(entry, route_url), runner, stopped, alive)
        except LOST:
            pass
        finally:
            with contextlib.suppress(Exception):  # its attempts go back uncharged now, or at its deadline
                await client.close()
        if not stopped.done():
            why = client.broken or "a heartbeat could not reach the store"
            print(
                f"left store session {client.session_id} ({why}): its attempts went back to the queue; joining again",
                flush=True,
            )
    print(f"left the job at {url} (store sessions {', '.join(sessions) or 'none'}): {stopped.result()}", flush=True)
    return {"store": url, "sessions": sessions, "ended": stopped.result()}


def run_runner(url: str, api_key: str | None, n: int, route_url: str | None = None) -> dict:
    """A runner process's work where a launcher starts it (a Ray actor, a SLURM job: agl/agents/launch.py):
    ``join`` with ``n`` runners, without taking the process's signals (the launcher's)."""
    return asyncio.run(join(url, api_key, RunnerConfig(n=n), route_url=route_url, signals=False))
