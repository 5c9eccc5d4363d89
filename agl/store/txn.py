"""The store's state changes, as synchronous steps inside one write transaction.

`rules.py` decides (pure functions); this module applies those decisions to
the rows. Every function takes a `Tx` — the connection, the clock reading of
the transaction, and the list of rollouts that became terminal (so the store
can wake waiters after COMMIT, never before). All of them run on the store's
worker thread inside `BEGIN IMMEDIATE`, and each touches a bounded number of
rows through an index: nothing here scans a table.
"""

from __future__ import annotations

import secrets
import sqlite3
from typing import Any, Optional

from agl.store import rules
from agl.store.codec import (
    ATTEMPT_COLUMNS,
    ROLLOUT_COLUMNS,
    RolloutRow,
    attempt_from_row,
)
from agl.types import Attempt, AttemptStatus, RolloutConfig, RolloutStatus

# Attempts processed per query when expiring deadlines; the loop repeats until
# none is due, so this only bounds the size of one result set.
_EXPIRE_BATCH = 256


class Tx:
    """What a write transaction carries besides the connection."""

    __slots__ = ("conn", "now", "session_id", "finished")

    def __init__(self, conn: sqlite3.Connection, now: float, session_id: Optional[str]):
        self.conn = conn
        self.now = now
        self.session_id = session_id
        self.finished: list[str] = []  # rollouts that entered a terminal status


def new_rollout_id() -> str:
    return "ro-" + secrets.token_hex(8)


def new_attempt_id() -> str:
    return "at-" + secrets.token_hex(8)


def new_resources_id() -> str:
    return "rs-" + secrets.token_hex(8)


# -- lookups -------------------------------------------------------------------


def find_rollout(conn: sqlite3.Connection, rollout_id: str) -> Optional[RolloutRow]:
    raw = conn.execute(f"SELECT {ROLLOUT_COLUMNS} FROM rollouts WHERE rollout_id = ?", (rollout_id,)).fetchone()
    return None if raw is None else RolloutRow(raw)


def get_rollout(conn: sqlite3.Connection, rollout_id: str) -> RolloutRow:
    row = find_rollout(conn, rollout_id)
    if row is None:
        raise ValueError(f"Rollout {rollout_id!r} not found")
    return row


def get_attempt_row(conn: sqlite3.Connection, rollout: RolloutRow, attempt_id: str) -> tuple[Any, ...]:
    """The attempt `attempt_id` ("latest" allowed) of `rollout`, or ValueError."""
    if attempt_id == "latest":
        if rollout.num_attempts == 0:
            raise ValueError(f"Rollout {rollout.rollout_id!r} has no attempts")
        raw = conn.execute(
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE rollout_id = ? AND sequence_id = ?",
            (rollout.rollout_id, rollout.num_attempts),
        ).fetchone()
    else:
        raw = conn.execute(
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE attempt_id = ? AND rollout_id = ?",
            (attempt_id, rollout.rollout_id),
        ).fetchone()
    if raw is None:
        raise ValueError(f"Attempt {attempt_id!r} not found for rollout {rollout.rollout_id!r}")
    return raw


def latest_resources_id(conn: sqlite3.Connection) -> Optional[str]:
    raw = conn.execute("SELECT resources_id FROM resources ORDER BY version DESC LIMIT 1").fetchone()
    return None if raw is None else raw[0]


def require_resources(conn: sqlite3.Connection, resources_id: str) -> None:
    if conn.execute("SELECT 1 FROM resources WHERE resources_id = ?", (resources_id,)).fetchone() is None:
        raise ValueError(f"Resources {resources_id!r} not found")


# -- status transitions --------------------------------------------------------


def _next_queue_seq(conn: sqlite3.Connection) -> int:
    raw = conn.execute(
        "SELECT queue_seq FROM rollouts WHERE queue_seq IS NOT NULL ORDER BY queue_seq DESC LIMIT 1"
    ).fetchone()
    return 1 if raw is None else raw[0] + 1


def set_rollout_status(tx: Tx, rollout_id: str, current: str, new: RolloutStatus) -> None:
    """Move a rollout to `new`, keeping the queue index and end_time in step (R1, R5, R8)."""
    if new == current:
        return
    conn = tx.conn
    if rules.is_queued(new):
        if rules.is_queued(current):
            conn.execute("UPDATE rollouts SET status = ? WHERE rollout_id = ?", (new.value, rollout_id))
        else:
            conn.execute(
                "UPDATE rollouts SET status = ?, queue_seq = ?, end_time = NULL WHERE rollout_id = ?",
                (new.value, _next_queue_seq(conn), rollout_id),
            )
    elif rules.is_terminal(new):
        conn.execute(
            "UPDATE rollouts SET status = ?, queue_seq = NULL, end_time = ? WHERE rollout_id = ?",
            (new.value, tx.now, rollout_id),
        )
        tx.finished.append(rollout_id)
    else:
        conn.execute(
            "UPDATE rollouts SET status = ?, queue_seq = NULL, end_time = NULL WHERE rollout_id = ?",
            (new.value, rollout_id),
        )


def propagate(tx: Tx, rollout: RolloutRow, attempt_sequence_id: int, attempt_status: str) -> None:
    """R4 + R5: carry the latest attempt's status to a non-terminal rollout."""
    if attempt_sequence_id != rollout.num_attempts or rules.is_terminal(rollout.status):
        return
    target = rules.rollout_status_for_attempt(AttemptStatus(attempt_status), attempt_sequence_id, rollout.config)
    set_rollout_status(tx, rollout.rollout_id, rollout.status, target)


def set_attempt_status(tx: Tx, attempt_id: str, status: AttemptStatus) -> tuple[Any, ...]:
    """Set an attempt's status and end_time; returns the updated row (ATTEMPT_COLUMNS)."""
    if rules.is_active(status):
        sql = f"UPDATE attempts SET status = ?, end_time = NULL WHERE attempt_id = ? RETURNING {ATTEMPT_COLUMNS}"
        params: tuple[Any, ...] = (status.value, attempt_id)
    else:
        sql = (
            "UPDATE attempts SET status = ?, end_time = coalesce(end_time, ?) "
            f"WHERE attempt_id = ? RETURNING {ATTEMPT_COLUMNS}"
        )
        params = (status.value, tx.now, attempt_id)
    return tx.conn.execute(sql, params).fetchone()


def finish_attempt_by_store(tx: Tx, attempt_id: str, rollout_id: str, status: AttemptStatus) -> Attempt:
    """A status the store itself decides (R6 deadline, R7 dead owner), then R4."""
    raw = set_attempt_status(tx, attempt_id, status)
    propagate(tx, get_rollout(tx.conn, rollout_id), raw[2], raw[3])
    return attempt_from_row(raw)


# -- creation ------------------------------------------------------------------


def insert_rollout(
    tx: Tx,
    *,
    input_json: Optional[str],
    mode: Optional[str],
    resources_id: Optional[str],
    config_json: str,
    metadata_json: Optional[str],
    status: RolloutStatus,
    queue_seq: Optional[int],
) -> RolloutRow:
    raw = (
        new_rollout_id(), input_json, mode, resources_id, status.value, config_json, metadata_json,
        tx.now, None, 0, 0, queue_seq,
    )
    tx.conn.execute(f"INSERT INTO rollouts ({ROLLOUT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", raw)
    return RolloutRow(raw)


def next_queue_seq(tx: Tx) -> int:
    return _next_queue_seq(tx.conn)


def create_attempt(tx: Tx, rollout: RolloutRow, worker_id: Optional[str]) -> Attempt:
    """R2: attempt n+1, `preparing`, owned by this session; the rollout becomes `preparing`."""
    config: RolloutConfig = rollout.config
    sequence_id = rollout.num_attempts + 1
    attempt = Attempt(
        rollout_id=rollout.rollout_id,
        attempt_id=new_attempt_id(),
        sequence_id=sequence_id,
        start_time=tx.now,
        status=AttemptStatus.PREPARING,
        worker_id=worker_id,
        session_id=tx.session_id,
    )
    timeout_at = None if config.timeout_seconds is None else tx.now + config.timeout_seconds
    tx.conn.execute(
        "INSERT INTO attempts (attempt_id, rollout_id, sequence_id, status, start_time, worker_id, "
        "session_id, timeout_at, unresponsive_seconds) VALUES (?,?,?,?,?,?,?,?,?)",
        (attempt.attempt_id, attempt.rollout_id, sequence_id, AttemptStatus.PREPARING.value, tx.now,
         worker_id, tx.session_id, timeout_at, config.unresponsive_seconds),
    )
    tx.conn.execute(
        "UPDATE rollouts SET num_attempts = ?, status = 'preparing', queue_seq = NULL, end_time = NULL "
        "WHERE rollout_id = ?",
        (sequence_id, rollout.rollout_id),
    )
    return attempt


def refresh_deadlines(tx: Tx, rollout_id: str, config: RolloutConfig) -> None:
    """R6: a new config applies to the rollout's active attempts too."""
    tx.conn.execute(
        "UPDATE attempts SET timeout_at = start_time + ?, unresponsive_seconds = ? "
        "WHERE rollout_id = ? AND status IN ('preparing', 'running')",
        (config.timeout_seconds, config.unresponsive_seconds, rollout_id),
    )


# -- deadlines and dead owners -------------------------------------------------


def has_due_deadline(conn: sqlite3.Connection, now: float) -> bool:
    """One index probe: is any active attempt past its deadline?"""
    return conn.execute("SELECT 1 FROM attempts WHERE deadline <= ? LIMIT 1", (now,)).fetchone() is not None


def expire_due_attempts(tx: Tx) -> list[Attempt]:
    """R6: every active attempt past its deadline becomes timeout/unresponsive."""
    changed: list[Attempt] = []
    while True:
        rows = tx.conn.execute(
            "SELECT attempt_id, rollout_id, timeout_at FROM attempts WHERE deadline <= ? "
            "ORDER BY deadline, rowid LIMIT ?",
            (tx.now, _EXPIRE_BATCH),
        ).fetchall()
        if not rows:
            return changed
        for attempt_id, rollout_id, timeout_at in rows:
            status = rules.expired_status(timeout_at, tx.now)
            changed.append(finish_attempt_by_store(tx, attempt_id, rollout_id, status))


def orphan_session_attempts(tx: Tx, session_id: str) -> list[Attempt]:
    """R7: the active attempts of an ended session become unresponsive."""
    rows = tx.conn.execute(
        "SELECT attempt_id, rollout_id FROM attempts WHERE session_id = ? AND status IN ('preparing', 'running')",
        (session_id,),
    ).fetchall()
    return [
        finish_attempt_by_store(tx, attempt_id, rollout_id, AttemptStatus.UNRESPONSIVE)
        for attempt_id, rollout_id in rows
    ]
