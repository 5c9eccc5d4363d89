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
  primary keys), so operations cost O(log n) in the size of the store.
* Waiting, deadlines, dead processes and the watchdog live in watch.py;
  resources in resources.py; checkpoints, metrics and run info in runstate.py.

Unknown ids raise `ValueError` in every method that acts on or lists under an
id. The two plain lookups, `get_rollout_by_id` and `get_resources_by_id`,
return None for an unknown id (their agent-lightning signatures are Optional),
and `query_rollouts(rollout_ids=...)` is a filter: unknown ids just match nothing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, TypeVar, Union

from agl.store import db, rules, sessions, txn
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
from agl.store.resources import ResourcesMixin
from agl.store.runstate import RunStateMixin
from agl.store.watch import ReadOnlyStoreError, WatchMixin
from agl.store.txn import Tx
from agl.types import (
    UNSET,
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Rollout,
    RolloutConfig,
    RolloutMode,
    RolloutStatus,
    Span,
    Unset,
)


T = TypeVar("T")
StatusFilter = Union[RolloutStatus, str, Sequence[Union[RolloutStatus, str]], None]
ConfigArg = Union[RolloutConfig, dict[str, Any], None]


class SqliteStore(WatchMixin, ResourcesMixin, RunStateMixin):
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
        self._clock = clock
        self._busy_timeout = busy_timeout
        self._synchronous = synchronous
        self._keep_checkpoints = keep_checkpoints
        self._watchdog_interval = watchdog_interval
        self._poll_interval = poll_interval
        self._session_check_interval = session_check_interval
        self._closed = False
        self._init_watch()
        self.session = None if readonly else sessions.current_session()
        self._conn: Any = None
        self._worker = db.Worker("agl-store")
        if not _defer_open:
            self._worker.call(self._open_or_clean_up)

    @classmethod
    async def open(cls, path: Union[str, Path], **kwargs: Any) -> "SqliteStore":
        """Like the constructor, but the file is opened on the worker thread, so the
        running event loop does not block on it (schema, session, dead-process check)."""
        store = cls(path, _defer_open=True, **kwargs)
        await store._worker.run(store._open_or_clean_up)
        return store

    @classmethod
    def open_readonly(cls, path: Union[str, Path], **kwargs: Any) -> "SqliteStore":
        """Open an existing store for reading only, next to a live writer if need be."""
        return cls(path, readonly=True, **kwargs)

    @property
    def session_id(self) -> Optional[str]:
        """This store's session (None when read-only); attempts it creates carry it."""
        return None if self.session is None else self.session.session_id

    async def session_alive(self, session_id: str) -> bool:
        """Whether the session is open and its process still runs (R7's test, so a process of
        another host counts as alive). False for an unknown id."""

        def read(conn: Any) -> bool:
            row = conn.execute(
                "SELECT pid, process_start_time, hostname, closed_time FROM sessions WHERE session_id = ?",
                (session_id,),
            ).fetchone()
            return row is not None and row[3] is None and sessions.is_alive(sessions.SessionInfo(session_id, *row[:3]))

        return await self._read(read)

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
        self._conn = db.connect(
            self.path, readonly=self.readonly, busy_timeout=self._busy_timeout, synchronous=self._synchronous
        )
        if self.readonly:
            db.check_schema(self._conn)
            return
        db.install_schema(self._conn)
        with db.write_transaction(self._conn):
            self.session = sessions.register(self._conn, self.session)  # type: ignore[arg-type]
        self._reap_dead_sessions()

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

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
            self._wake_all()

    def _close_sync(self) -> None:
        try:
            if not self.readonly and self._conn is not None:
                self._write_sync(self._end_session_tx)
        finally:
            self._close_connection()

    def _end_session_tx(self, tx: Tx) -> None:
        txn.end_session(tx, self.session_id, "closed")  # type: ignore[arg-type]

    async def __aenter__(self) -> "SqliteStore":
        if not self.readonly and self._watchdog_interval is not None:
            await self.start_watchdog(self._watchdog_interval)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- plumbing ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"store {self.path} is closed")

    def _write_sync(self, fn: Callable[..., T], *args: Any) -> T:
        tx = Tx(self._conn, self._clock(), self.session_id)
        with db.write_transaction(self._conn):
            result = fn(tx, *args)
        if tx.finished:
            self._notify(tx.finished)
        return result

    def _durable_write_sync(self, fn: Callable[..., T], *args: Any) -> T:
        # synchronous=FULL for this one COMMIT: it is fsynced (with all before it).
        self._conn.execute("PRAGMA synchronous=FULL")
        try:
            return self._write_sync(fn, *args)
        finally:
            self._conn.execute(f"PRAGMA synchronous={self._synchronous}")

    async def _write(self, fn: Callable[..., T], *args: Any, durable: bool = False) -> T:
        """Run `fn(tx, *args)` in one write transaction on the worker thread;
        `durable=True` flushes its commit to disk whatever `synchronous` is."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only")
        return await self._worker.run(self._durable_write_sync if durable else self._write_sync, fn, *args)

    def _read_sync(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.readonly:
            self._expire_due()  # R6 before every read: nobody sees an overdue attempt as active
        with db.read_transaction(self._conn):
            return fn(self._conn, *args)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in one read transaction (a consistent snapshot), after
        applying due deadlines if the store is writable (R6)."""
        self._check_open()
        return await self._worker.run(self._read_sync, fn, *args)

    # -- rollouts ----------------------------------------------------------------

    def _new_rollout_tx(
        self, tx: Tx, input: Any, mode: Optional[str], resources_id: Optional[str],
        config: ConfigArg, metadata: Optional[dict[str, Any]], status: RolloutStatus, queue_seq: Optional[int],
    ) -> RolloutRow:
        if resources_id is None:
            resources_id = txn.latest_resources_id(tx.conn)
        else:
            txn.require_resources(tx.conn, resources_id)
        cfg = config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config or {})
        row = txn.insert_rollout(
            tx, input_json=dumps_or_none(input), mode=mode, resources_id=resources_id,
            config_json=cfg.model_dump_json(), metadata_json=dumps(metadata or {}),
            status=status, queue_seq=queue_seq,
        )
        row.to_model()  # validate (mode, ...) before COMMIT; an error rolls back
        return row

    def _enqueue_tx(
        self, tx: Tx, inputs: Sequence[Any], mode: Optional[str], resources_id: Optional[str],
        config: ConfigArg, metadata: Union[dict[str, Any], Sequence[dict[str, Any]], None],
    ) -> list[Rollout]:
        metas = metadata if isinstance(metadata, (list, tuple)) else [metadata] * len(inputs)
        if len(metas) != len(inputs):
            raise ValueError("metadata must be one dict, or one per input")
        seq = txn.next_queue_seq(tx)
        rows = [
            self._new_rollout_tx(tx, inp, mode, resources_id, config, meta, RolloutStatus.QUEUING, seq + i)
            for i, (inp, meta) in enumerate(zip(inputs, metas))
        ]
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
        return (await self._write(self._enqueue_tx, [input], mode, resources_id, config, metadata))[0]

    async def enqueue_rollouts(
        self,
        inputs: Sequence[Any],
        mode: Optional[RolloutMode] = None,
        resources_id: Optional[str] = None,
        config: ConfigArg = None,
        metadata: Union[dict[str, Any], Sequence[dict[str, Any]], None] = None,
    ) -> list[Rollout]:
        """Enqueue many rollouts in one transaction, in order: all of them or none.

        This is how a trainer enqueues a step's batch so that a crash never
        leaves half a step in the queue. `metadata` is one dict for all, or one
        per input."""
        return await self._write(self._enqueue_tx, list(inputs), mode, resources_id, config, metadata)

    def _start_rollout_tx(
        self, tx: Tx, input: Any, mode: Optional[str], resources_id: Optional[str],
        config: ConfigArg, metadata: Optional[dict[str, Any]], worker_id: Optional[str],
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
        return await self._write(self._start_rollout_tx, input, mode, resources_id, config, metadata, worker_id)

    def _dequeue_sync(self, worker_id: Optional[str]) -> Optional[AttemptedRollout]:
        # Read-only probe first: an idle runner polling an empty queue must not
        # take the write lock (that would stall the writers of other processes).
        conn = self._conn
        now = self._clock()
        queued = conn.execute("SELECT 1 FROM rollouts WHERE queue_seq IS NOT NULL LIMIT 1").fetchone()
        if queued is None and not txn.has_due_deadline(conn, now):
            return None
        return self._write_sync(self._dequeue_tx, worker_id)

    def _dequeue_tx(self, tx: Tx, worker_id: Optional[str]) -> Optional[AttemptedRollout]:
        txn.expire_due_attempts(tx)  # R6, cheaply: one index probe when nothing is due
        raw = tx.conn.execute(
            f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE queue_seq IS NOT NULL ORDER BY queue_seq LIMIT 1"
        ).fetchone()
        if raw is None:
            return None
        row = RolloutRow(raw)
        attempt = txn.create_attempt(tx, row, worker_id)
        return row.to_attempted(attempt, status=RolloutStatus.PREPARING, end_time=None)

    async def dequeue_rollout(self, worker_id: Optional[str] = None) -> Optional[AttemptedRollout]:
        """Take the oldest queued rollout and create its next attempt (R2); None if the
        queue is empty. Never blocks; never hands a queue entry out twice."""
        self._check_open()
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only")
        return await self._worker.run(self._dequeue_sync, worker_id)

    def _start_attempt_tx(self, tx: Tx, rollout_id: str, worker_id: Optional[str]) -> AttemptedRollout:
        row = txn.get_rollout(tx.conn, rollout_id)
        attempt = txn.create_attempt(tx, row, worker_id)
        return row.to_attempted(attempt, status=RolloutStatus.PREPARING, end_time=None)

    async def start_attempt(self, rollout_id: str, worker_id: Optional[str] = None) -> AttemptedRollout:
        """Create the next attempt of a rollout on demand (R2: an explicit retry)."""
        return await self._write(self._start_attempt_tx, rollout_id, worker_id)

    def _query_rollouts(
        self, conn: Any, statuses: Optional[list[str]], rollout_ids: Optional[list[str]], step: Optional[int]
    ) -> list[Rollout]:
        view = self._overdue_view(conn)
        where, params = [], []
        if statuses is not None:
            clause = "status IN (SELECT value FROM json_each(?))"
            params.append(dumps(statuses))
            if view.rollouts:  # read-only: their status as shown may not be the stored one
                clause = f"({clause} OR rollout_id IN (SELECT value FROM json_each(?)))"
                params.append(dumps(list(view.rollouts)))
            where.append(clause)
        if rollout_ids is not None:
            where.append("rollout_id IN (SELECT value FROM json_each(?))")
            params.append(dumps(rollout_ids))
        if step is not None:
            where.append("step = ?")
            params.append(step)
        sql = f"SELECT {ROLLOUT_COLUMNS} FROM rollouts"
        if where:
            sql += " WHERE " + " AND ".join(where)
        found = [view.rollout(RolloutRow(raw)) for raw in conn.execute(sql + " ORDER BY seq", params)]
        if statuses is None or not view.rollouts:
            return found
        return [r for r in found if r.status in statuses]

    async def query_rollouts(
        self,
        status: StatusFilter = None,
        rollout_ids: Optional[Sequence[str]] = None,
        *,
        step: Optional[int] = None,
    ) -> list[Rollout]:
        """Rollouts in creation order, filtered by status (one or a list), ids and/or
        training step (`metadata["step"]`, indexed)."""
        statuses = None
        if status is not None:
            statuses = [RolloutStatus(status).value] if isinstance(status, str) else [
                RolloutStatus(s).value for s in status
            ]
        ids = None if rollout_ids is None else list(rollout_ids)
        return await self._read(self._query_rollouts, statuses, ids, step)

    async def get_rollout_by_id(self, rollout_id: str) -> Optional[Rollout]:
        """The rollout, or None if there is no such id."""

        def read(conn: Any) -> Optional[Rollout]:
            row = txn.find_rollout(conn, rollout_id)
            return None if row is None else self._overdue_view(conn, [rollout_id]).rollout(row)

        return await self._read(read)

    def _update_rollout_tx(
        self, tx: Tx, rollout_id: str, input: Any, mode: Any, resources_id: Any,
        status: Any, config: Any, metadata: Any,
    ) -> Rollout:
        row = txn.get_rollout(tx.conn, rollout_id)
        sets: list[str] = []
        params: list[Any] = []
        if input is not UNSET:
            sets.append("input = ?")
            params.append(dumps_or_none(input))
        if mode is not UNSET:
            sets.append("mode = ?")
            params.append(mode)
        if resources_id is not UNSET:
            if resources_id is not None:
                txn.require_resources(tx.conn, resources_id)
            sets.append("resources_id = ?")
            params.append(resources_id)
        if config is not UNSET:
            cfg = config if isinstance(config, RolloutConfig) else RolloutConfig.model_validate(config or {})
            sets.append("config = ?")
            params.append(cfg.model_dump_json())
            txn.refresh_deadlines(tx, rollout_id, cfg)
        if metadata is not UNSET:
            sets.append("metadata = ?")
            params.append(dumps_or_none(metadata))
        if sets:
            tx.conn.execute(f"UPDATE rollouts SET {', '.join(sets)} WHERE rollout_id = ?", (*params, rollout_id))
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
        return await self._write(
            self._update_rollout_tx, rollout_id, input, mode, resources_id, status, config, metadata
        )

    # -- attempts ----------------------------------------------------------------

    async def query_attempts(self, rollout_id: str) -> list[Attempt]:
        """All attempts of a rollout, oldest first."""

        def read(conn: Any) -> list[Attempt]:
            txn.get_rollout(conn, rollout_id)
            rows = conn.execute(
                f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE rollout_id = ? ORDER BY sequence_id",
                (rollout_id,),
            )
            view = self._overdue_view(conn, rollout_ids=[])  # attempts only
            return [view.attempt(r) for r in rows]

        return await self._read(read)

    async def get_latest_attempt(self, rollout_id: str) -> Optional[Attempt]:
        """The rollout's latest attempt, or None if it has none yet."""

        def read(conn: Any) -> Optional[Attempt]:
            row = txn.get_rollout(conn, rollout_id)
            if row.num_attempts == 0:
                return None
            return self._overdue_view(conn, rollout_ids=[]).attempt(txn.get_attempt_row(conn, row, "latest"))

        return await self._read(read)

    def _update_attempt_tx(
        self, tx: Tx, rollout_id: str, attempt_id: str, status: Any, worker_id: Any,
        last_heartbeat_time: Any, metadata: Any,
    ) -> Attempt:
        rollout = txn.get_rollout(tx.conn, rollout_id)
        raw = txn.get_attempt_row(tx.conn, rollout, attempt_id)
        real_id = raw[1]
        sets: list[str] = []
        params: list[Any] = []
        if worker_id is not UNSET:
            sets.append("worker_id = ?")
            params.append(worker_id)
        if last_heartbeat_time is not UNSET:
            sets.append("last_heartbeat_time = ?")
            params.append(last_heartbeat_time)
        if metadata is not UNSET:
            sets.append("metadata = ?")
            params.append(dumps_or_none(metadata))
        if sets:
            raw = tx.conn.execute(
                f"UPDATE attempts SET {', '.join(sets)} WHERE attempt_id = ? RETURNING {ATTEMPT_COLUMNS}",
                (*params, real_id),
            ).fetchone()
        if status is not UNSET:
            raw = txn.set_attempt_status(tx, real_id, AttemptStatus(status))
            txn.propagate(tx, rollout, raw[2], raw[3])  # R4 (only if latest, R5)
        return attempt_from_row(raw)

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
        return await self._write(
            self._update_attempt_tx, rollout_id, attempt_id, status, worker_id, last_heartbeat_time, metadata
        )

    # -- spans -------------------------------------------------------------------

    def _add_span_tx(self, tx: Tx, span: Span) -> Span:
        conn = tx.conn
        found = conn.execute(
            "SELECT a.sequence_id, a.status, r.status, r.config, r.num_attempts, r.last_span_seq "
            "FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
            "WHERE a.attempt_id = ? AND a.rollout_id = ?",
            (span.attempt_id, span.rollout_id),
        ).fetchone()
        if found is None:
            rollout = txn.get_rollout(conn, span.rollout_id)  # raises for an unknown rollout
            txn.get_attempt_row(conn, rollout, span.attempt_id)  # raises for an unknown attempt
        attempt_seq, attempt_status, rollout_status, config_json, num_attempts, last_span_seq = found
        sequence_id = last_span_seq + 1 if span.sequence_id is None else span.sequence_id
        conn.execute(f"INSERT INTO spans ({SPAN_COLUMNS}) VALUES ({SPAN_PLACEHOLDERS})", span_params(span, sequence_id))

        # R3: the span is a heartbeat; it may revive the latest attempt.
        is_latest = attempt_seq == num_attempts
        new_status = rules.attempt_status_after_heartbeat(AttemptStatus(attempt_status), is_latest)
        conn.execute("UPDATE attempts SET last_heartbeat_time = ? WHERE attempt_id = ?", (tx.now, span.attempt_id))
        if new_status != attempt_status:
            txn.set_attempt_status(tx, span.attempt_id, new_status)
        if sequence_id > last_span_seq:
            conn.execute(
                "UPDATE rollouts SET last_span_seq = ? WHERE rollout_id = ?", (sequence_id, span.rollout_id)
            )
        if is_latest and new_status == AttemptStatus.RUNNING and rollout_status != RolloutStatus.RUNNING:
            rollout = RolloutRow.partial(span.rollout_id, rollout_status, config_json, num_attempts)
            txn.propagate(tx, rollout, attempt_seq, new_status)  # R4
        if span.sequence_id is None:
            return span.model_copy(update={"sequence_id": sequence_id})
        return span

    async def add_span(self, span: Span) -> Span:
        """Store a span (sequence_id assigned if None) and count it as a heartbeat (R3).
        Returns the stored span."""
        return await self._write(self._add_span_tx, span)

    def _next_span_seq_tx(self, tx: Tx, rollout_id: str, attempt_id: str) -> int:
        rollout = txn.get_rollout(tx.conn, rollout_id)
        txn.get_attempt_row(tx.conn, rollout, attempt_id)
        return tx.conn.execute(
            "UPDATE rollouts SET last_span_seq = last_span_seq + 1 WHERE rollout_id = ? RETURNING last_span_seq",
            (rollout_id,),
        ).fetchone()[0]

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        """Reserve the next span sequence id of the rollout: strictly increasing within
        the rollout, never issued twice."""
        return await self._write(self._next_span_seq_tx, rollout_id, attempt_id)

    async def query_spans(
        self, rollout_id: str, attempt_id: Union[str, Literal["latest"], None] = None
    ) -> list[Span]:
        """Spans of a rollout in sequence order: all attempts (None), the latest
        attempt ("latest"), or one attempt."""

        def read(conn: Any) -> list[Span]:
            rollout = txn.get_rollout(conn, rollout_id)
            if attempt_id is None:
                rows = conn.execute(
                    f"SELECT {SPAN_COLUMNS} FROM spans WHERE rollout_id = ? ORDER BY sequence_id", (rollout_id,)
                )
            else:
                if attempt_id == "latest" and rollout.num_attempts == 0:
                    return []
                real_id = txn.get_attempt_row(conn, rollout, attempt_id)[1]
                rows = conn.execute(
                    f"SELECT {SPAN_COLUMNS} FROM spans WHERE rollout_id = ? AND attempt_id = ? ORDER BY sequence_id",
                    (rollout_id, real_id),
                )
            return [span_from_row(r) for r in rows]

        return await self._read(read)

