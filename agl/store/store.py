"""`SqliteStore`: the LightningStore of the harness, one SQLite file per run.

The algorithm enqueues rollouts and waits for them; runners dequeue them, write
spans and finish attempts; the model route writes one span per LLM call; the
trainer saves its run state (runstate.py). The API keeps agent-lightning
v0.2's `LightningStore` names and semantics; the status rules are documented
once, in `agl/store/rules.py`, and the schema in `schema.sql`.

How it is built:
* Every method is `async` and makes exactly one hop to the store's worker
  thread, which owns the connection (db.py). The event loop never blocks on
  SQLite, and a process's operations are serialized without locks.
* Writes are one `BEGIN IMMEDIATE` transaction each (txn.py), so concurrent
  dequeues — from tasks, threads or other processes on the same file — never
  hand out the same rollout twice, and a `kill -9` leaves either all or none
  of an operation.
* Every hot-path statement is an index probe (queue head, deadline index,
  primary keys; a step's or an evaluation's rollouts: the step and tag indexes),
  so operations cost O(log n) in the size of the store.
* The store is composed of parts that share one `db.Db` (the connection, its
  worker thread, one transaction per operation): rollouts, attempts and spans
  here; waiting, deadlines, dead processes and the watchdog in watch.py;
  resources in resources.py; checkpoints, metrics and run info in runstate.py.
  `SqliteStore`'s methods are the public API and forward to the parts.

Unknown ids raise `ValueError` in every method that acts on or lists under an
id. The two plain lookups, `get_rollout_by_id` and `get_resources_by_id`,
return None for an unknown id (their agent-lightning signatures are Optional),
and `query_rollouts(rollout_ids=...)` is a filter: unknown ids just match nothing.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Optional, Union

import agl.store.db as db
import agl.store.rules as rules
import agl.store.sessions as sessions
import agl.store.txn as txn
from agl.store.codec import (
    ATTEMPT_COLUMNS,
    ROLLOUT_COLUMNS,
    SPAN_COLUMNS,
    SPAN_PLACEHOLDERS,
    RolloutRow,
    attempt_from_row,
    dumps,
    dumps_or_none,
    span_from_row,
    span_params,
)
from agl.store.db import ReadOnlyStoreError
from agl.store.resources import Resources
from agl.store.runstate import RunState
from agl.store.txn import Tx
from agl.store.watch import Waiters, Watch
from agl.types import (
    UNSET,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Checkpoint,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    Unset,
)

__all__ = ["SqliteStore", "ReadOnlyStoreError"]

StatusFilter = Union[RolloutStatus, str, Sequence[Union[RolloutStatus, str]], None]
ConfigArg = Union[RolloutConfig, dict[str, Any], None]


def _given(**fields: Any) -> dict[str, Any]:
    """The fields an update call was given (UNSET: leave as is)."""
    return {name: value for name, value in fields.items() if value is not UNSET}


def _rollout_config(config: ConfigArg) -> RolloutConfig:
    return config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config or {})


# A metadata key SQL can name in a JSON path literal, which is what lets a query use the
# expression indexes on `json_extract(metadata, '$.<key>')` (schema.sql).
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_INT64 = range(-(2**63), 2**63)


def _add_metadata_condition(where: db.Where, key: str, value: Any) -> None:
    """Narrow a rollout query to `metadata[key] == value` where SQL can: a plain key and a
    scalar value (None: missing or null). Never excludes a rollout Python's == would keep;
    the caller confirms each row with ==."""
    if not isinstance(key, str) or not _PLAIN_KEY.match(key):
        return
    column = "step" if key == "step" else f"json_extract(metadata, '$.{key}')"  # step: its generated column
    if value is None:
        where.add(f"{column} IS NULL")
    elif isinstance(value, (str, float)) or (isinstance(value, int) and value in _INT64):
        where.add(f"{column} = ?", value)


class SqliteStore:
    """The run's store. See the module docstring; status rules in `agl/store/rules.py`.

    Args:
        path: the SQLite file (created with its parent directory if writable).
        clock: returns the current time in seconds; injectable so tests can drive
            deadlines. All stored times come from it.
        readonly: open for reading only (e.g. a `report` command next to a live
            run); writes raise `ReadOnlyStoreError`. See also `open_readonly`.
        busy_timeout: seconds to wait for another process's write lock.
        synchronous: "NORMAL" (default; durable across process crashes) or
            "FULL" (also across power loss, at an fsync per commit). See db.py.
        keep_checkpoints: how many latest checkpoints keep their blobs.
        watchdog_interval: period of the deadline watchdog started by
            `async with store` (None: do not start it there).
        poll_interval: how often `wait_for_rollouts` looks for commits of other
            processes and applies due deadlines.
        session_check_interval: how often `check_timeouts` looks for dead processes.
    """

    def __init__(
        self,
        path: Union[str, Path],
        *,
        clock: Callable[[], float] = time.time,
        readonly: bool = False,
        busy_timeout: float = 30.0,
        synchronous: db.Synchronous = "NORMAL",
        keep_checkpoints: int = 2,
        watchdog_interval: Optional[float] = 1.0,
        poll_interval: float = 0.2,
        session_check_interval: float = 5.0,
        _defer_open: bool = False,
    ):
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError("synchronous must be 'NORMAL' or 'FULL'")
        if keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be at least 1")
        self.path = Path(path)
        self.readonly = readonly
        self._watchdog_interval = watchdog_interval
        self.session = None if readonly else sessions.current_session()
        waiters = Waiters()
        self._db = db.Db(
            self.path,
            readonly=readonly,
            clock=clock,
            busy_timeout=busy_timeout,
            synchronous=synchronous,
            on_commit=waiters.notify,
        )
        self._worker = self._db.worker
        self._watch = Watch(
            self._db,
            waiters,
            poll_interval=poll_interval,
            session_check_interval=session_check_interval,
            watchdog_interval=watchdog_interval,
        )
        self._resources = Resources(self._db)
        self._run_state = RunState(self._db, keep_checkpoints)
        if not _defer_open:
            self._worker.call(self._open_or_clean_up)

    @classmethod
    async def open(cls, path: Union[str, Path], **kwargs: Any) -> SqliteStore:
        """Like the constructor, but the file is opened on the worker thread, so the
        running event loop does not block on it (schema, session, dead-process check)."""
        store = cls(path, _defer_open=True, **kwargs)
        await store._worker.run(store._open_or_clean_up)
        return store

    @classmethod
    def open_readonly(cls, path: Union[str, Path], **kwargs: Any) -> SqliteStore:
        """Open an existing store for reading only, next to a live writer if need be."""
        return cls(path, readonly=True, **kwargs)

    @property
    def session_id(self) -> Optional[str]:
        """This store's session (None when read-only); attempts it creates carry it."""
        return None if self.session is None else self.session.session_id

    async def session_alive(self, session_id: str) -> bool:
        """Whether the session is open and alive: its process still runs (R7's test, so a process of
        another host counts as alive), or, a client's session, it still heartbeats. False for an unknown id."""

        def read(conn: Any) -> bool:
            found = sessions.find(conn, session_id)
            return found is not None and sessions.is_alive(found, self._db.clock())

        return await self._db.read(read)

    # -- client sessions (a store served over HTTP: agl/store/server.py) -----------

    async def open_client_session(self, hostname: str, pid: int, heartbeat_seconds: float) -> str:
        """Register a client's session: alive while it heartbeats (`heartbeat_session`) at least every
        `heartbeat_seconds`, then ended as dead (R7). Returns its id; writes made `acting_for` it are its own."""
        if not heartbeat_seconds > 0:
            raise ValueError(f"heartbeat_seconds must be positive, not {heartbeat_seconds}")

        def register(tx: Tx) -> str:
            info = sessions.SessionInfo(None, pid, None, hostname, heartbeat_seconds, tx.now)
            return sessions.register(tx.conn, info).session_id  # type: ignore[return-value]

        return await self._db.run(self._db.maintain_sync, register, writes=True)

    async def heartbeat_session(self, session_id: str) -> bool:
        """A client session's heartbeat; False once it has ended (closed, or dead for want of heartbeats)."""
        return await self._db.run(
            self._db.maintain_sync, lambda tx: sessions.heartbeat(tx.conn, session_id, tx.now), writes=True
        )

    async def end_session(self, session_id: str, how: rules.SessionEnd = "closed") -> list[Attempt]:
        """End a session (R7): its active attempts go back to the queue uncharged. Idempotent."""
        return await self._db.run(self._db.maintain_sync, txn.end_session, session_id, how, writes=True)

    async def renew_leases(self) -> None:
        """Every open client session's heartbeat deadline counts from now (a store server starting again)."""
        await self._db.run(self._db.maintain_sync, lambda tx: sessions.renew_leases(tx.conn, tx.now), writes=True)

    @staticmethod
    @contextlib.contextmanager
    def acting_for(session_id: Optional[str]) -> Iterator[None]:
        """Inside the block (this task and what it awaits), writes are made for `session_id`: the attempts
        they create are its own (R7), and they are refused with `SessionEnded` once it has ended."""
        token = db.acting_session.set(session_id)
        try:
            yield
        finally:
            db.acting_session.reset(token)

    # -- lifecycle ---------------------------------------------------------------

    def _open_or_clean_up(self) -> None:
        try:
            self._open()
        except BaseException:
            self._close_connection()
            self._closed = True
            threading.Thread(target=self._worker.shutdown, daemon=True).start()  # not from its own thread
            raise

    def _open(self) -> None:
        self._db.connect()
        if self.readonly:
            return
        with self._db.damage_named():
            with db.write_transaction(self._db.conn):
                self.session = sessions.register(self._db.conn, self.session)  # type: ignore[arg-type]
            self._db.session_id = self.session.session_id
            self._watch.reap_dead_sessions_sync()

    # A store is dropped the way kill -9 would drop it (tests/store_helpers.abandon) through these.
    @property
    def _closed(self) -> bool:
        return self._db.closed

    @_closed.setter
    def _closed(self, value: bool) -> None:
        self._db.closed = value

    def _close_connection(self) -> None:
        self._db.close_connection()

    async def close(self) -> None:
        """Stop the watchdog, end this session (R7: its active attempts become
        unresponsive and their rollouts go back to the queue, uncharged) and close
        the file. Idempotent."""
        if self._closed:
            return
        await self.stop_watchdog()
        self._closed = True
        try:
            await self._worker.run(self._close_sync)
        finally:
            self._worker.shutdown()
            self._watch.waiters.wake_all()

    def _close_sync(self) -> None:
        try:
            if not self.readonly and self._db.conn is not None and not self._db.full:  # full: as after kill -9
                self._db.maintain_sync(self._end_session_tx)
        finally:
            self._close_connection()

    def _end_session_tx(self, tx: Tx) -> None:
        txn.end_session(tx, self.session_id, "closed")  # type: ignore[arg-type]

    async def __aenter__(self) -> SqliteStore:
        if not self.readonly and self._watchdog_interval is not None:
            await self.start_watchdog(self._watchdog_interval)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- rollouts ----------------------------------------------------------------

    def _new_rollout_tx(
        self,
        tx: Tx,
        input: Any,
        mode: Optional[str],
        resources_id: Optional[str],
        config: ConfigArg,
        metadata: Optional[dict[str, Any]],
        status: RolloutStatus,
        queue_seq: Optional[int],
    ) -> RolloutRow:
        if resources_id is None:
            resources_id = txn.latest_resources_id(tx.conn)
        else:
            txn.require_resources(tx.conn, resources_id)
        cfg = _rollout_config(config)
        row = txn.insert_rollout(
            tx,
            input_json=dumps_or_none(input),
            mode=mode,
            resources_id=resources_id,
            config_json=cfg.model_dump_json(),
            metadata_json=dumps(metadata or {}),
            status=status,
            queue_seq=queue_seq,
        )
        row.to_model()  # validate (mode, ...) before COMMIT; an error rolls back
        return row

    def _enqueue_tx(
        self,
        tx: Tx,
        inputs: Sequence[Any],
        mode: Optional[str],
        resources_id: Optional[str],
        config: ConfigArg,
        metadata: Union[dict[str, Any], Sequence[dict[str, Any]], None],
        finished: Optional[Sequence[Optional[RolloutStatus]]] = None,
    ) -> list[Rollout]:
        metas = metadata if isinstance(metadata, (list, tuple)) else [metadata] * len(inputs)
        if len(metas) != len(inputs):
            raise ValueError("metadata must be one dict, or one per input")
        ends = list(finished) if finished is not None else [None] * len(inputs)
        if len(ends) != len(inputs):
            raise ValueError("finished must be one status (or None) per input")
        seq = txn.next_queue_seq(tx)
        rows = []
        for i, (inp, meta, end) in enumerate(zip(inputs, metas, ends)):
            row = self._new_rollout_tx(tx, inp, mode, resources_id, config, meta, RolloutStatus.QUEUING, seq + i)
            if end is not None:  # R1: recorded finished, never queued
                if not rules.is_terminal(RolloutStatus(end)):
                    raise ValueError(f"finished: {end!r} is not a terminal rollout status")
                txn.set_rollout_status(tx, row.rollout_id, row.status, RolloutStatus(end))
                row = txn.get_rollout(tx.conn, row.rollout_id)
            rows.append(row)
        return [row.to_model() for row in rows]

    async def enqueue_rollout(
        self,
        input: Any,
        mode: Optional[RolloutMode] = None,
        resources_id: Optional[str] = None,
        config: ConfigArg = None,
        metadata: Optional[dict[str, Any]] = None,
    ) -> Rollout:
        """Add a `queuing` rollout at the back of the queue (R1).

        `metadata={"step": n, ...}` ties it to training step n (see
        `query_rollouts(step=n)`)."""
        return (await self._db.write(self._enqueue_tx, [input], mode, resources_id, config, metadata))[0]

    async def enqueue_rollouts(
        self,
        inputs: Sequence[Any],
        mode: Optional[RolloutMode] = None,
        resources_id: Optional[str] = None,
        config: ConfigArg = None,
        metadata: Union[dict[str, Any], Sequence[dict[str, Any]], None] = None,
        finished: Optional[Sequence[Union[RolloutStatus, str, None]]] = None,
    ) -> list[Rollout]:
        """Enqueue many rollouts in one transaction, in order: all of them or none.

        This is how a trainer enqueues a step's batch so that a crash never
        leaves half a step in the queue. `metadata` is one dict for all, or one
        per input. `finished` (one per input) records a rollout whose outcome is
        already known in that terminal status instead of queuing it (R1): an eval
        cache's rows take their place and ids among the rollouts run (agl/eval/cache.py)."""
        return await self._db.write(self._enqueue_tx, list(inputs), mode, resources_id, config, metadata, finished)

    def _start_rollout_tx(
        self,
        tx: Tx,
        input: Any,
        mode: Optional[str],
        resources_id: Optional[str],
        config: ConfigArg,
        metadata: Optional[dict[str, Any]],
        worker_id: Optional[str],
    ) -> AttemptedRollout:
        row = self._new_rollout_tx(tx, input, mode, resources_id, config, metadata, RolloutStatus.PREPARING, None)
        attempt = txn.create_attempt(tx, row, worker_id)
        return row.to_attempted(attempt)

    async def start_rollout(
        self,
        input: Any,
        mode: Optional[RolloutMode] = None,
        resources_id: Optional[str] = None,
        config: ConfigArg = None,
        metadata: Optional[dict[str, Any]] = None,
        worker_id: Optional[str] = None,
    ) -> AttemptedRollout:
        """Create a rollout and its attempt 1, both `preparing`, bypassing the queue (R1)."""
        return await self._db.write(self._start_rollout_tx, input, mode, resources_id, config, metadata, worker_id)

    def _dequeue_sync(self, worker_id: Optional[str]) -> Optional[AttemptedRollout]:
        # Read-only probe first: an idle runner polling an empty queue must not
        # take the write lock (that would stall the writers of other processes).
        conn = self._db.conn
        now = self._db.clock()
        queued = conn.execute("SELECT 1 FROM rollouts WHERE queue_seq IS NOT NULL LIMIT 1").fetchone()
        if queued is None and not txn.has_due_deadline(conn, now):
            return None
        return self._db.write_sync(self._dequeue_tx, worker_id)

    def _dequeue_tx(self, tx: Tx, worker_id: Optional[str]) -> Optional[AttemptedRollout]:
        txn.expire_due_attempts(tx)  # R6, cheaply: one index probe when nothing is due
        head = tx.conn.execute(
            f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE queue_seq IS NOT NULL ORDER BY queue_seq LIMIT 1"
        ).fetchone()
        if head is None:
            return None
        row = RolloutRow(head)
        attempt = txn.create_attempt(tx, row, worker_id)
        return row.to_attempted(attempt, status=RolloutStatus.PREPARING, end_time=None)

    async def dequeue_rollout(self, worker_id: Optional[str] = None) -> Optional[AttemptedRollout]:
        """Take the oldest queued rollout and create its next attempt (R2); None if the
        queue is empty. Never blocks; never hands a queue entry out twice."""
        return await self._db.run(self._dequeue_sync, worker_id, writes=True)

    def _start_attempt_tx(self, tx: Tx, rollout_id: str, worker_id: Optional[str]) -> AttemptedRollout:
        row = txn.get_rollout(tx.conn, rollout_id)
        attempt = txn.create_attempt(tx, row, worker_id)
        return row.to_attempted(attempt, status=RolloutStatus.PREPARING, end_time=None)

    async def start_attempt(self, rollout_id: str, worker_id: Optional[str] = None) -> AttemptedRollout:
        """Create the next attempt of a rollout on demand (R2: an explicit retry)."""
        return await self._db.write(self._start_attempt_tx, rollout_id, worker_id)

    def _query_rollouts(
        self,
        conn: Any,
        statuses: Optional[list[str]],
        rollout_ids: Optional[list[str]],
        step: Optional[int],
        metadata: Optional[dict[str, Any]],
    ) -> list[Rollout]:
        view = self._db.overdue_view(conn)
        where = db.Where()
        if statuses is not None:
            clause = "status IN (SELECT value FROM json_each(?))"
            params = [dumps(statuses)]
            if view.rollouts:  # read-only: their status as shown may not be the stored one
                clause = f"({clause} OR rollout_id IN (SELECT value FROM json_each(?)))"
                params.append(dumps(list(view.rollouts)))
            where.add(clause, *params)
        if rollout_ids is not None:
            where.add("rollout_id IN (SELECT value FROM json_each(?))", dumps(rollout_ids))
        if step is not None:
            where.add("step = ?", step)
        for key, value in (metadata or {}).items():
            _add_metadata_condition(where, key, value)
        rows = conn.execute(f"SELECT {ROLLOUT_COLUMNS} FROM rollouts{where} ORDER BY seq", where.params)
        found = [view.rollout(RolloutRow(row)) for row in rows]
        if metadata:  # what SQL narrowed, confirmed with Python's == (SQL cannot decide every value)
            found = [r for r in found if all((r.metadata or {}).get(k, None) == v for k, v in metadata.items())]
        if statuses is None or not view.rollouts:
            return found
        return [r for r in found if r.status in statuses]

    async def query_rollouts(
        self,
        status: StatusFilter = None,
        rollout_ids: Optional[Sequence[str]] = None,
        *,
        step: Optional[int] = None,
        metadata: Optional[Mapping[str, Any]] = None,
    ) -> list[Rollout]:
        """Rollouts in creation order, filtered by status (one or a list), ids, training
        step (`metadata["step"]`, indexed) and/or `metadata`: those whose metadata has
        each of these keys equal to its value (a missing key equals None). Indexed for the
        evaluations' tags `eval_step`, `eval` and `candidate` (schema.sql); other keys
        are matched by reading every rollout."""
        statuses = None
        if status is not None:
            statuses = (
                [RolloutStatus(status).value] if isinstance(status, str) else [RolloutStatus(s).value for s in status]
            )
        ids = None if rollout_ids is None else list(rollout_ids)
        return await self._db.read(
            self._query_rollouts, statuses, ids, step, None if metadata is None else dict(metadata)
        )

    async def get_rollout_by_id(self, rollout_id: str) -> Optional[Rollout]:
        """The rollout, or None if there is no such id."""

        def read(conn: Any) -> Optional[Rollout]:
            row = txn.find_rollout(conn, rollout_id)
            return None if row is None else self._db.overdue_view(conn, [rollout_id]).rollout(row)

        return await self._db.read(read)

    def _update_rollout_tx(self, tx: Tx, rollout_id: str, changes: dict[str, Any]) -> Rollout:
        row = txn.get_rollout(tx.conn, rollout_id, txn.RULE_COLUMNS)
        status = changes.pop("status", UNSET)
        if changes.get("resources_id") is not None:
            txn.require_resources(tx.conn, changes["resources_id"])
        if "config" in changes:
            cfg = _rollout_config(changes["config"])
            changes["config"] = cfg.model_dump_json()
            txn.refresh_deadlines(tx, rollout_id, cfg)
        for column in ("input", "metadata"):
            if column in changes:
                changes[column] = dumps_or_none(changes[column])
        db.update(tx.conn, "rollouts", changes, key=("rollout_id", rollout_id))
        if status is not UNSET:
            txn.set_rollout_status(tx, rollout_id, row.status, RolloutStatus(status))  # R8
        return txn.get_rollout(tx.conn, rollout_id).to_model()

    async def update_rollout(
        self,
        rollout_id: str,
        input: Any = UNSET,
        mode: Union[Optional[RolloutMode], Unset] = UNSET,
        resources_id: Union[Optional[str], Unset] = UNSET,
        status: Union[RolloutStatus, str, Unset] = UNSET,
        config: Union[RolloutConfig, dict[str, Any], Unset] = UNSET,
        metadata: Union[Optional[dict[str, Any]], Unset] = UNSET,
    ) -> Rollout:
        """Change the given fields (UNSET: leave as is; None: set to null). `metadata`
        replaces the old dict. A status is set as given (R8); a new config also
        moves the deadlines of the rollout's active attempts (R6)."""
        changes = _given(
            input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata
        )
        return await self._db.write(self._update_rollout_tx, rollout_id, changes)

    # -- attempts ----------------------------------------------------------------

    async def query_attempts(self, rollout_id: str) -> list[Attempt]:
        """All attempts of a rollout, oldest first."""

        def read(conn: Any) -> list[Attempt]:
            txn.get_rollout(conn, rollout_id, txn.RULE_COLUMNS)  # raises for an unknown rollout
            rows = conn.execute(
                f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE rollout_id = ? ORDER BY sequence_id",
                (rollout_id,),
            )
            view = self._db.overdue_view(conn, rollout_ids=[])  # attempts only
            return [view.attempt(r) for r in rows]

        return await self._db.read(read)

    async def get_latest_attempt(self, rollout_id: str) -> Optional[Attempt]:
        """The rollout's latest attempt, or None if it has none yet."""

        def read(conn: Any) -> Optional[Attempt]:
            row = txn.get_rollout(conn, rollout_id, txn.RULE_COLUMNS)
            if row.num_attempts == 0:
                return None
            return self._db.overdue_view(conn, rollout_ids=[]).attempt(txn.get_attempt_row(conn, row, "latest"))

        return await self._db.read(read)

    def _update_attempt_tx(self, tx: Tx, rollout_id: str, attempt_id: str, changes: dict[str, Any]) -> Attempt:
        rollout = txn.get_rollout(tx.conn, rollout_id, txn.RULE_COLUMNS)
        row = txn.get_attempt_row(tx.conn, rollout, attempt_id)
        real_id = row["attempt_id"]
        status = changes.pop("status", UNSET)
        if "metadata" in changes:
            changes["metadata"] = dumps_or_none(changes["metadata"])
        row = db.update(tx.conn, "attempts", changes, key=("attempt_id", real_id), returning=ATTEMPT_COLUMNS) or row
        if status is not UNSET:
            row = txn.set_attempt_status(tx, real_id, AttemptStatus(status))
            txn.propagate(tx, rollout, row["sequence_id"], row["status"])  # R4 (only if latest, R5)
        return attempt_from_row(row)

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: Union[str, Literal["latest"]],
        status: Union[AttemptStatus, str, Unset] = UNSET,
        worker_id: Union[Optional[str], Unset] = UNSET,
        last_heartbeat_time: Union[Optional[float], Unset] = UNSET,
        metadata: Union[Optional[dict[str, Any]], Unset] = UNSET,
    ) -> Attempt:
        """Change an attempt (or the rollout's "latest"). A status change of the latest
        attempt propagates to the rollout (R4), e.g. `status="succeeded"` finishes it."""
        changes = _given(status=status, worker_id=worker_id, last_heartbeat_time=last_heartbeat_time, metadata=metadata)
        return await self._db.write(self._update_attempt_tx, rollout_id, attempt_id, changes)

    # -- spans -------------------------------------------------------------------

    def _add_span_tx(self, tx: Tx, span: Span) -> Span:
        conn = tx.conn
        found = conn.execute(
            "SELECT a.sequence_id AS attempt_seq, a.status AS attempt_status, "
            "r.rollout_id, r.status, r.config, r.num_attempts, r.last_span_seq "
            "FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
            "WHERE a.attempt_id = ? AND a.rollout_id = ?",
            (span.attempt_id, span.rollout_id),
        ).fetchone()
        if found is None:
            rollout = txn.get_rollout(conn, span.rollout_id)  # raises for an unknown rollout
            txn.get_attempt_row(conn, rollout, span.attempt_id)  # raises for an unknown attempt
        attempt_seq, attempt_status, last_span_seq = (
            found["attempt_seq"],
            found["attempt_status"],
            found["last_span_seq"],
        )
        rollout = RolloutRow(found)  # the columns the status rules read
        sequence_id = last_span_seq + 1 if span.sequence_id is None else span.sequence_id
        conn.execute(f"INSERT INTO spans ({SPAN_COLUMNS}) VALUES ({SPAN_PLACEHOLDERS})", span_params(span, sequence_id))

        # R3: the span is a heartbeat; it may revive the latest attempt.
        is_latest = attempt_seq == rollout.num_attempts
        new_status = rules.attempt_status_after_heartbeat(AttemptStatus(attempt_status), is_latest)
        conn.execute("UPDATE attempts SET last_heartbeat_time = ? WHERE attempt_id = ?", (tx.now, span.attempt_id))
        if new_status != attempt_status:
            txn.set_attempt_status(tx, span.attempt_id, new_status)
        if sequence_id > last_span_seq:
            conn.execute("UPDATE rollouts SET last_span_seq = ? WHERE rollout_id = ?", (sequence_id, span.rollout_id))
        if is_latest and new_status == AttemptStatus.RUNNING and rollout.status != RolloutStatus.RUNNING:
            txn.propagate(tx, rollout, attempt_seq, new_status)  # R4
        if span.sequence_id is None:
            return span.model_copy(update={"sequence_id": sequence_id})
        return span

    async def add_span(self, span: Span) -> Span:
        """Store a span (sequence_id assigned if None) and count it as a heartbeat (R3).
        Returns the stored span."""
        return await self._db.write(self._add_span_tx, span)

    def _next_span_seq_tx(self, tx: Tx, rollout_id: str, attempt_id: str) -> int:
        rollout = txn.get_rollout(tx.conn, rollout_id, txn.RULE_COLUMNS)
        txn.get_attempt_row(tx.conn, rollout, attempt_id)
        return tx.conn.execute(
            "UPDATE rollouts SET last_span_seq = last_span_seq + 1 WHERE rollout_id = ? RETURNING last_span_seq",
            (rollout_id,),
        ).fetchone()[0]

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        """Reserve the next span sequence id of the rollout: strictly increasing within
        the rollout, never issued twice."""
        return await self._db.write(self._next_span_seq_tx, rollout_id, attempt_id)

    async def query_spans(self, rollout_id: str, attempt_id: Union[str, Literal["latest"], None] = None) -> list[Span]:
        """Spans of a rollout in sequence order: all attempts (None), the latest
        attempt ("latest"), or one attempt."""

        def read(conn: Any) -> list[Span]:
            rollout = txn.get_rollout(conn, rollout_id, txn.RULE_COLUMNS)
            if attempt_id is None:
                rows = conn.execute(
                    f"SELECT {SPAN_COLUMNS} FROM spans WHERE rollout_id = ? ORDER BY sequence_id", (rollout_id,)
                )
            else:
                if attempt_id == "latest" and rollout.num_attempts == 0:
                    return []
                real_id = txn.get_attempt_row(conn, rollout, attempt_id)["attempt_id"]
                rows = conn.execute(
                    f"SELECT {SPAN_COLUMNS} FROM spans WHERE rollout_id = ? AND attempt_id = ? ORDER BY sequence_id",
                    (rollout_id, real_id),
                )
            return [span_from_row(r) for r in rows]

        return await self._db.read(read)

    # -- waiting and liveness (watch.py) -----------------------------------------

    async def wait_for_rollouts(self, rollout_ids: Sequence[str], timeout: Optional[float] = None) -> list[Rollout]:
        """Wait until all the rollouts are terminal or `timeout` seconds pass; return
        those that are terminal by then, in the order asked.

        Wakes as soon as this process finishes one; commits of other processes are
        noticed within `poll_interval`. `timeout=0` just checks."""
        return await self._watch.wait_for_rollouts(rollout_ids, timeout)

    async def check_timeouts(self) -> list[Attempt]:
        """Enforce deadlines (R6) and, every `session_check_interval`, dead owners (R7).
        Returns the attempts whose status changed."""
        return await self._watch.check_timeouts()

    async def reap_dead_sessions(self) -> list[Attempt]:
        """Apply R7 now to every session whose process has died."""
        return await self._watch.reap_dead_sessions()

    async def start_watchdog(self, interval: Optional[float] = None) -> None:
        """Run `check_timeouts()` every `interval` seconds (default: watchdog_interval)
        in a background task of the running loop, until `stop_watchdog()`/`close()`."""
        await self._watch.start_watchdog(interval)

    async def stop_watchdog(self) -> None:
        await self._watch.stop_watchdog()

    # -- resources (resources.py) ------------------------------------------------

    async def add_resources(self, resources: dict[str, Any], resources_id: Optional[str] = None) -> ResourcesUpdate:
        """Store a new resources version under a new id (or the given unused one); it
        becomes the latest, which rollouts created without resources_id get (R1)."""
        return await self._resources.add_resources(resources, resources_id)

    async def update_resources(self, resources_id: str, resources: dict[str, Any]) -> ResourcesUpdate:
        """Replace the content of existing resources; like agent-lightning, they also
        become the latest."""
        return await self._resources.update_resources(resources_id, resources)

    async def get_resources_by_id(self, resources_id: str) -> Optional[ResourcesUpdate]:
        """The resources, or None if there is no such id."""
        return await self._resources.get_resources_by_id(resources_id)

    async def get_latest_resources(self) -> Optional[ResourcesUpdate]:
        return await self._resources.get_latest_resources()

    # -- run state (runstate.py) -------------------------------------------------

    async def set_run_info(self, key: str, value: Any) -> None:
        """Store a JSON-able value under `key` (e.g. "config", "git_commit")."""
        await self._run_state.set_run_info(key, value)

    async def get_run_info(self, key: str, default: Any = None) -> Any:
        return await self._run_state.get_run_info(key, default)

    async def get_all_run_info(self) -> dict[str, Any]:
        return await self._run_state.get_all_run_info()

    async def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record metrics of a step (nested dicts flattened with '/'); a name logged
        again for the same step replaces the old value."""
        await self._run_state.log_metrics(step, metrics)

    async def query_metrics(
        self, step: Optional[int] = None, names: Optional[list[str]] = None
    ) -> dict[int, dict[str, Any]]:
        """{step: {name: value}} in step order, optionally for one step / some names."""
        return await self._run_state.query_metrics(step, names)

    async def save_checkpoint(
        self,
        step: int,
        policy_version: int,
        state: Mapping[str, Any],
        blobs: Optional[Mapping[str, bytes]] = None,
        metrics: Optional[Mapping[str, Any]] = None,
    ) -> Checkpoint:
        """Atomically save the run state after `step` (replacing a checkpoint of the
        same step): JSON `state`, binary `blobs` (adapter weights, optimizer state,
        torch RNG, ...) and, if given, the step's metrics (as `log_metrics`)."""
        return await self._run_state.save_checkpoint(step, policy_version, state, blobs, metrics)

    async def load_checkpoint(self, step: Optional[int] = None) -> Optional[Checkpoint]:
        """The checkpoint of `step`, or the latest one (highest step); None if there is
        none. A checkpoint whose blobs were pruned comes back with `blobs_pruned=True`."""
        return await self._run_state.load_checkpoint(step)

    async def list_checkpoints(self) -> list[Checkpoint]:
        """All checkpoints, oldest step first, without their blobs (cheap)."""
        return await self._run_state.list_checkpoints()
