"""Waiting and liveness: `wait_for_rollouts`, deadlines (R6), dead owners (R7)
and the background watchdog, as a mixin of `SqliteStore`.

Waiting is event-driven: a transaction that makes rollouts terminal records
their ids, and after COMMIT the worker thread sets the events of the waiters on
those ids (each on its own loop, thread-safely). Commits made by *other*
processes raise no event here, so a waiter also looks at `PRAGMA data_version`
— a counter SQLite bumps when another connection commits — every
`poll_interval`, and re-reads its rollouts by primary key only when it moved.
Neither path ever reads the whole table.

Deadlines are enforced by `check_timeouts()` (the watchdog calls it), and
also cheaply before every dequeue and every read, waiter polls included: one
probe of the partial index on `attempts.deadline`. A read-only store applies
them in memory instead (overdue.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar

from agl.store import db, rules, sessions, txn
from agl.store.codec import ROLLOUT_COLUMNS, RolloutRow, dumps
from agl.store.overdue import NOTHING_OVERDUE, OverdueView
from agl.types import Attempt, Rollout

logger = logging.getLogger("agl.store")

T = TypeVar("T")


class ReadOnlyStoreError(RuntimeError):
    """A write was attempted on a store opened with `readonly=True`."""


class _Waiter:
    """One `wait_for_rollouts` call: an event on its own loop, set from any thread."""

    __slots__ = ("loop", "event")

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # its loop is closed: nobody is waiting any more
            pass


class WatchMixin:
    """Waiting, deadlines, dead sessions and the watchdog (see the module docstring)."""

    # Provided by SqliteStore.
    path: Any
    readonly: bool
    session_id: Optional[str]
    _conn: Any
    _worker: db.Worker
    _clock: Callable[[], float]
    _closed: bool
    _poll_interval: float
    _session_check_interval: float
    _watchdog_interval: Optional[float]

    def _init_watch(self) -> None:
        self._waiters: dict[str, set[_Waiter]] = {}
        self._waiters_lock = threading.Lock()
        self._watchdog_task: Optional[asyncio.Task[None]] = None
        self._last_session_check = time.monotonic()

    def _check_open(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _write_sync(self, fn: Callable[..., T], *args: Any) -> T:  # pragma: no cover - interface
        raise NotImplementedError

    # -- waiters -----------------------------------------------------------------

    def _notify(self, rollout_ids: Iterable[str]) -> None:
        with self._waiters_lock:
            targets = {w for rid in rollout_ids for w in self._waiters.get(rid, ())}
        for waiter in targets:
            waiter.wake()

    def _wake_all(self) -> None:
        with self._waiters_lock:
            targets = {w for ws in self._waiters.values() for w in ws}
        for waiter in targets:
            waiter.wake()

    def _register(self, rollout_ids: Iterable[str], waiter: _Waiter) -> None:
        with self._waiters_lock:
            for rid in rollout_ids:
                self._waiters.setdefault(rid, set()).add(waiter)

    def _unregister(self, rollout_ids: Iterable[str], waiter: _Waiter) -> None:
        with self._waiters_lock:
            for rid in rollout_ids:
                ws = self._waiters.get(rid)
                if ws is not None:
                    ws.discard(waiter)
                    if not ws:
                        del self._waiters[rid]

    # -- waiting -----------------------------------------------------------------

    def _wait_probe(
        self, rollout_ids: list[str], last_version: Optional[int], check_unknown: bool
    ) -> tuple[Optional[dict[str, Rollout]], int]:
        """Apply due deadlines, then return the terminal ones among `rollout_ids`, or
        None if no other process committed since `last_version` (nothing to re-read)."""
        if not self.readonly:
            self._expire_due()
        conn = self._conn
        with db.read_transaction(conn):
            view = self._overdue_view(conn, rollout_ids)
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if version == last_version and not view.rollouts:  # time alone can make a read-only view change
                return None, version
            rows = [
                RolloutRow(raw)
                for raw in conn.execute(
                    f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id IN (SELECT value FROM json_each(?))",
                    (dumps(rollout_ids),),
                )
            ]
        if check_unknown and len(rows) < len(rollout_ids):
            known = {r.rollout_id for r in rows}
            unknown = [rid for rid in rollout_ids if rid not in known]
            raise ValueError(f"Rollouts not found: {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        shown = [view.rollout(r) for r in rows]
        return {r.rollout_id: r for r in shown if rules.is_terminal(r.status)}, version

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> list[Rollout]:
        """Wait until all the rollouts are terminal or `timeout` seconds pass; return
        those that are terminal by then, in the order asked.

        Wakes as soon as this process finishes one; commits of other processes are
        noticed within `poll_interval`. `timeout=0` just checks."""
        self._check_open()
        ids = list(dict.fromkeys(rollout_ids))
        if not ids:
            return []
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        waiter = _Waiter()
        self._register(ids, waiter)  # before the first read: no wake-up can be lost
        done: dict[str, Rollout] = {}
        pending = ids
        version: Optional[int] = None
        first = True
        try:
            while True:
                self._check_open()  # a store closed under the waiter: say so clearly
                woken = waiter.event.is_set()
                waiter.event.clear()
                found, version = await self._worker.run(
                    self._wait_probe, pending, None if (first or woken) else version, first
                )
                first = False
                if found:
                    done.update(found)
                    pending = [rid for rid in pending if rid not in done]
                if not pending:
                    break
                pause = self._poll_interval
                if deadline is not None:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    pause = min(pause, remaining)
                try:
                    await asyncio.wait_for(waiter.event.wait(), pause)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._unregister(ids, waiter)
        return [done[rid] for rid in ids if rid in done]

    # -- deadlines, dead sessions, watchdog --------------------------------------

    def _overdue_view(self, conn: Any, rollout_ids: Optional[Sequence[str]] = None) -> OverdueView:
        """How reads must show overdue attempts (and the rollouts `rollout_ids`, None: all):
        a writable store has expired them already (it applies R6 before every read), a
        read-only one shows R6 in memory."""
        return OverdueView.at(conn, self._clock(), rollout_ids) if self.readonly else NOTHING_OVERDUE

    def _expire_due(self) -> list[Attempt]:
        if not txn.has_due_deadline(self._conn, self._clock()):
            return []
        return self._write_sync(txn.expire_due_attempts)

    def _reap_dead_sessions(self) -> list[Attempt]:
        self._last_session_check = time.monotonic()
        dead = sessions.find_dead(self._conn, exclude=self.session_id)
        changed: list[Attempt] = []
        for session_id in dead:
            logger.warning("store session %s is dead; its active attempts go back to the queue (R7)", session_id)
            changed += self._write_sync(txn.end_session, session_id, "dead")
        return changed

    def _check_timeouts_sync(self) -> list[Attempt]:
        changed: list[Attempt] = []
        if time.monotonic() - self._last_session_check >= self._session_check_interval:
            changed += self._reap_dead_sessions()
        changed += self._expire_due()
        return changed

    async def check_timeouts(self) -> list[Attempt]:
        """Enforce deadlines (R6) and, every `session_check_interval`, dead owners (R7).
        Returns the attempts whose status changed."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only")
        return await self._worker.run(self._check_timeouts_sync)

    async def reap_dead_sessions(self) -> list[Attempt]:
        """Apply R7 now to every session whose process has died."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only")
        return await self._worker.run(self._reap_dead_sessions)

    async def start_watchdog(self, interval: Optional[float] = None) -> None:
        """Run `check_timeouts()` every `interval` seconds (default: watchdog_interval)
        in a background task of the running loop, until `stop_watchdog()`/`close()`."""
        if self.readonly:
            raise ReadOnlyStoreError("a read-only store has no watchdog")
        self._check_open()
        if self._watchdog_task is not None and not self._watchdog_task.done():
            return
        period = interval if interval is not None else (self._watchdog_interval or 1.0)
        self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog(period), name="agl-store-watchdog")

    async def stop_watchdog(self) -> None:
        task, self._watchdog_task = self._watchdog_task, None
        if task is None or task.done():
            return
        task.cancel()
        if task.get_loop() is asyncio.get_running_loop():
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _watchdog(self, interval: float) -> None:
        while True:
            try:
                changed = await self.check_timeouts()
                if changed:
                    logger.info("watchdog: %d attempt(s) timed out or became unresponsive", len(changed))
            except asyncio.CancelledError:
                raise
            except Exception:  # keep watching: one failed pass (e.g. a busy lock) is not fatal
                logger.exception("store watchdog pass failed")
            await asyncio.sleep(interval)
