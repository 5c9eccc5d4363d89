"""Waiting and liveness: `wait_for_rollouts`, deadlines (R6), dead owners (R7)
and the background watchdog, a part of `SqliteStore` (which forwards its public
methods here).

Waiting is event-driven: a transaction that makes rollouts terminal records
their ids, and after COMMIT the worker thread sets the events of the waiters on
those ids (each on its own loop, thread-safely). Commits made by *other*
processes raise no event here, so a waiter also looks at `PRAGMA data_version`
— a counter SQLite bumps when another connection commits — every
`poll_interval`, and re-reads its rollouts by primary key only when it moved.
Neither path ever reads the whole table.

Deadlines are enforced by `check_timeouts()` (the watchdog calls it), with the
heartbeat deadlines of client sessions (sessions.py) on every pass, and
also cheaply before every dequeue and every read, waiter polls included: one
probe of the partial index on `attempts.deadline`. A read-only store applies
them in memory instead (overdue.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Optional

import agl.store.db as db
import agl.store.rules as rules
import agl.store.sessions as sessions
import agl.store.txn as txn
from agl.errors import DiskFull
from agl.store.codec import ROLLOUT_COLUMNS, RolloutRow, dumps
from agl.types import Attempt, Rollout

logger = logging.getLogger("agl.store")

# Open client sessions whose heartbeats stopped (sessions.is_alive's rule, in SQL: no process to ask)
EXPIRED_LEASES = (
    "SELECT session_id FROM sessions WHERE closed_time IS NULL AND heartbeat_seconds IS NOT NULL "
    "AND coalesce(heartbeat_time, 0) + heartbeat_seconds <= ? ORDER BY rowid"
)


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


class Waiters:
    """Who waits for which rollouts. `notify` runs on the worker thread after a COMMIT
    (it is the store's `Db.on_commit`); the rest on the waiters' loops."""

    def __init__(self) -> None:
        self._by_rollout: dict[str, set[_Waiter]] = {}
        self._lock = threading.Lock()

    def notify(self, rollout_ids: Iterable[str]) -> None:
        with self._lock:
            targets = {w for rid in rollout_ids for w in self._by_rollout.get(rid, ())}
        for waiter in targets:
            waiter.wake()

    def wake_all(self) -> None:
        with self._lock:
            targets = {w for ws in self._by_rollout.values() for w in ws}
        for waiter in targets:
            waiter.wake()

    def register(self, rollout_ids: Iterable[str], waiter: _Waiter) -> None:
        with self._lock:
            for rid in rollout_ids:
                self._by_rollout.setdefault(rid, set()).add(waiter)

    def unregister(self, rollout_ids: Iterable[str], waiter: _Waiter) -> None:
        with self._lock:
            for rid in rollout_ids:
                ws = self._by_rollout.get(rid)
                if ws is not None:
                    ws.discard(waiter)
                    if not ws:
                        del self._by_rollout[rid]


class Watch:
    """Waiting, deadlines, dead sessions and the watchdog (see the module docstring)."""

    def __init__(
        self,
        store_db: db.Db,
        waiters: Waiters,
        *,
        poll_interval: float,
        session_check_interval: float,
        watchdog_interval: Optional[float],
    ):
        self.db = store_db
        self.waiters = waiters
        self.poll_interval = poll_interval
        self.session_check_interval = session_check_interval
        self.watchdog_interval = watchdog_interval
        self._watchdog_task: Optional[asyncio.Task[None]] = None
        self._last_session_check = time.monotonic()

    # -- waiting -----------------------------------------------------------------

    def _wait_probe(
        self, rollout_ids: list[str], last_version: Optional[int], check_unknown: bool
    ) -> tuple[Optional[dict[str, Rollout]], int]:
        """Apply due deadlines, then return the terminal ones among `rollout_ids`, or
        None if no other process committed since `last_version` (nothing to re-read)."""
        if not self.db.readonly:
            self.db.expire_due()
        conn = self.db.conn
        with db.read_transaction(conn):
            view = self.db.overdue_view(conn, rollout_ids)
            version = conn.execute("PRAGMA data_version").fetchone()[0]
            if version == last_version and not view.rollouts:  # time alone can make a read-only view change
                return None, version
            rows = [
                RolloutRow(row)
                for row in conn.execute(
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

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float]) -> list[Rollout]:
        self.db.check_open()
        ids = list(dict.fromkeys(rollout_ids))
        if not ids:
            return []
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        waiter = _Waiter()
        self.waiters.register(ids, waiter)  # before the first read: no wake-up can be lost
        done: dict[str, Rollout] = {}
        pending = ids
        version: Optional[int] = None
        first = True
        try:
            while True:
                self.db.check_open()  # a store closed under the waiter: say so clearly
                woken = waiter.event.is_set()
                waiter.event.clear()
                found, version = await self.db.worker.run(
                    self._wait_probe, pending, None if (first or woken) else version, first
                )
                first = False
                if found:
                    done.update(found)
                    pending = [rid for rid in pending if rid not in done]
                if not pending:
                    break
                pause = self.poll_interval
                if deadline is not None:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        break
                    pause = min(pause, remaining)
                try:
                    await asyncio.wait_for(waiter.event.wait(), pause)
                except TimeoutError:
                    pass
        finally:
            self.waiters.unregister(ids, waiter)
        return [done[rid] for rid in ids if rid in done]

    # -- deadlines, dead sessions, watchdog --------------------------------------

    def reap_dead_sessions_sync(self, leases_only: bool = False) -> list[Attempt]:
        """R7 for every open session whose process died or whose heartbeats stopped (`leases_only`: only
        the latter, an SQL probe; the processes are asked every `session_check_interval`)."""
        now = self.db.clock()
        if leases_only:
            dead = [row[0] for row in self.db.conn.execute(EXPIRED_LEASES, (now,))]
        else:
            self._last_session_check = time.monotonic()
            dead = sessions.find_dead(self.db.conn, exclude=self.db.session_id, now=now)
        changed: list[Attempt] = []
        for session_id in dead:
            logger.warning("store session %s is dead; its active attempts go back to the queue (R7)", session_id)
            changed += self.db.maintain_sync(txn.end_session, session_id, "dead")
        return changed

    def _check_timeouts_sync(self) -> list[Attempt]:
        full = time.monotonic() - self._last_session_check >= self.session_check_interval
        changed = self.reap_dead_sessions_sync(leases_only=not full)
        changed += self.db.expire_due()
        return changed

    async def check_timeouts(self) -> list[Attempt]:
        return await self.db.run(self._check_timeouts_sync, writes=True)

    async def reap_dead_sessions(self) -> list[Attempt]:
        return await self.db.run(self.reap_dead_sessions_sync, writes=True)

    async def start_watchdog(self, interval: Optional[float]) -> None:
        if self.db.readonly:
            raise db.ReadOnlyStoreError("a read-only store has no watchdog")
        self.db.check_open()
        if self._watchdog_task is not None and not self._watchdog_task.done():
            return
        period = interval if interval is not None else (self.watchdog_interval or 1.0)
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
            except DiskFull:  # the job is stopping (its trainer gets the same error): nothing to watch
                return
            except Exception:  # keep watching: one failed pass (e.g. a busy lock) is not fatal
                logger.exception("store watchdog pass failed")
            await asyncio.sleep(interval)
