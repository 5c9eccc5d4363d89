"""The store's state changes, as synchronous steps inside one write transaction.

`rules.py` decides (pure functions); this module applies those decisions to
the rows. Every function takes a `Tx` — the connection, the clock reading of
the transaction, and the list of rollouts that became terminal (so the store
can wake waiters after COMMIT, never before). All of them run on the store's
worker thread inside `BEGIN IMMEDIATE`, and each touches a bounded number of
rows through an index: nothing here scans a table.

Ids are not random: they number rows in the store's own order (`ro-000001`,
its attempts `at-000001-1`, `at-000001-2`, resources `rs-000001`), so two runs
making the same calls get the same ids and anything keyed by them (sampling
seeds, reports, diffs of two stores) agrees. The write lock of `BEGIN
IMMEDIATE` makes "the next number" unique across processes sharing the file.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Optional

import agl.store.rules as rules
import agl.store.sessions as sessions
from agl.store.codec import (
    ATTEMPT_COLUMNS,
    ROLLOUT_COLUMNS,
    ROLLOUT_FIELDS,
    RolloutRow,
    attempt_from_row,
    dumps,
    loads_or_none,
    numbered_id,
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


# -- ids -----------------------------------------------------------------------


def attempt_id_for(rollout_id: str, sequence_id: int) -> str:
    """`at-000001-2`: attempt 2 of rollout `ro-000001`."""
    return f"at-{rollout_id.removeprefix('ro-')}-{sequence_id}"


def new_resources_id(conn: sqlite3.Connection, version: int) -> str:
    """`rs-<version it is created with>`; resources may also be given explicit ids,
    so a number already taken by one gets a suffix (still a function of the store)."""
    base = candidate = numbered_id("rs", version)
    suffix = 1
    while conn.execute("SELECT 1 FROM resources WHERE resources_id = ?", (candidate,)).fetchone():
        suffix += 1
        candidate = f"{base}-{suffix}"
    return candidate


# -- lookups -------------------------------------------------------------------


# What the status rules read of a rollout (RolloutRow works on these alone): updates that
# only apply the rules need not copy the input and metadata out of the file.
RULE_COLUMNS = "rollout_id, status, config, num_attempts"


def find_rollout(conn: sqlite3.Connection, rollout_id: str, columns: str = ROLLOUT_COLUMNS) -> Optional[RolloutRow]:
    row = conn.execute(f"SELECT {columns} FROM rollouts WHERE rollout_id = ?", (rollout_id,)).fetchone()
    return None if row is None else RolloutRow(row)


def get_rollout(conn: sqlite3.Connection, rollout_id: str, columns: str = ROLLOUT_COLUMNS) -> RolloutRow:
    row = find_rollout(conn, rollout_id, columns)
    if row is None:
        raise ValueError(f"Rollout {rollout_id!r} not found")
    return row


def get_attempt_row(conn: sqlite3.Connection, rollout: RolloutRow, attempt_id: str) -> sqlite3.Row:
    """The attempt `attempt_id` ("latest" allowed) of `rollout`, or ValueError."""
    if attempt_id == "latest":
        if rollout.num_attempts == 0:
            raise ValueError(f"Rollout {rollout.rollout_id!r} has no attempts")
        row = conn.execute(
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE rollout_id = ? AND sequence_id = ?",
            (rollout.rollout_id, rollout.num_attempts),
        ).fetchone()
    else:
        row = conn.execute(
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE attempt_id = ? AND rollout_id = ?",
            (attempt_id, rollout.rollout_id),
        ).fetchone()
    if row is None:
        raise ValueError(f"Attempt {attempt_id!r} not found for rollout {rollout.rollout_id!r}")
    return row


def latest_resources_id(conn: sqlite3.Connection) -> Optional[str]:
    row = conn.execute("SELECT resources_id FROM resources ORDER BY version DESC LIMIT 1").fetchone()
    return None if row is None else row[0]


def require_resources(conn: sqlite3.Connection, resources_id: str) -> None:
    if conn.execute("SELECT 1 FROM resources WHERE resources_id = ?", (resources_id,)).fetchone() is None:
        raise ValueError(f"Resources {resources_id!r} not found")


# -- status transitions --------------------------------------------------------


def _next_queue_seq(conn: sqlite3.Connection) -> int:
    row = conn.execute(
        "SELECT queue_seq FROM rollouts WHERE queue_seq IS NOT NULL ORDER BY queue_seq DESC LIMIT 1"
    ).fetchone()
    return 1 if row is None else row[0] + 1


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


# R7's note, as SQL. Not charged = carries it; a status change drops it (with the
# error it explains), since the note only describes how the attempt ended.
CHARGED = f"json_extract(metadata, '$.{rules.HARNESS_ENDED}') IS NULL"
DROP_NOTE = (
    f"metadata = CASE WHEN {CHARGED} THEN metadata ELSE json_remove(metadata, '$.{rules.HARNESS_ENDED}', '$.error') END"
)


def charged_attempts(conn: sqlite3.Connection, rollout_id: str) -> int:
    """R4's count: the rollout's attempts without the harness-ended note (a handful of
    rows, found through the UNIQUE (rollout_id, sequence_id) index)."""
    return conn.execute(f"SELECT count(*) FROM attempts WHERE rollout_id = ? AND {CHARGED}", (rollout_id,)).fetchone()[
        0
    ]


def propagate(
    tx: Tx, rollout: RolloutRow, attempt_sequence_id: int, attempt_status: str, harness_ended: bool = False
) -> None:
    """R4 + R5: carry the latest attempt's status to a non-terminal rollout."""
    if attempt_sequence_id != rollout.num_attempts or rules.is_terminal(rollout.status):
        return
    target = rules.rollout_status_for_attempt(
        AttemptStatus(attempt_status), charged_attempts(tx.conn, rollout.rollout_id), rollout.config, harness_ended
    )
    set_rollout_status(tx, rollout.rollout_id, rollout.status, target)


def set_attempt_status(tx: Tx, attempt_id: str, status: AttemptStatus) -> sqlite3.Row:
    """Set an attempt's status and end_time, dropping R7's note; an attempt made active
    again passes to this session (R7); returns the updated row (ATTEMPT_COLUMNS)."""
    if rules.is_active(status):
        sql = (
            f"UPDATE attempts SET status = ?, end_time = NULL, {DROP_NOTE}, "
            "session_id = CASE WHEN status IN ('preparing', 'running') THEN session_id ELSE ? END "
            f"WHERE attempt_id = ? RETURNING {ATTEMPT_COLUMNS}"
        )
        params: tuple[Any, ...] = (status.value, tx.session_id, attempt_id)
    else:
        sql = (
            f"UPDATE attempts SET status = ?, end_time = coalesce(end_time, ?), {DROP_NOTE} "
            f"WHERE attempt_id = ? RETURNING {ATTEMPT_COLUMNS}"
        )
        params = (status.value, tx.now, attempt_id)
    return tx.conn.execute(sql, params).fetchone()


def expire_attempt(tx: Tx, attempt_id: str, rollout_id: str, status: AttemptStatus) -> Attempt:
    """R6: the status a deadline gives, then R4."""
    row = set_attempt_status(tx, attempt_id, status)
    propagate(tx, get_rollout(tx.conn, rollout_id, RULE_COLUMNS), row["sequence_id"], row["status"])
    return attempt_from_row(row)


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
    # seq is the INTEGER PRIMARY KEY, so max(seq) is one b-tree probe; rollouts are never deleted.
    seq = tx.conn.execute("SELECT coalesce(max(seq), 0) + 1 FROM rollouts").fetchone()[0]
    values = (
        numbered_id("ro", seq),
        input_json,
        mode,
        resources_id,
        status.value,
        config_json,
        metadata_json,
        tx.now,
        None,
        0,
        0,
        queue_seq,
    )
    tx.conn.execute(f"INSERT INTO rollouts (seq, {ROLLOUT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", (seq, *values))
    return RolloutRow(dict(zip(ROLLOUT_FIELDS, values)))


def next_queue_seq(tx: Tx) -> int:
    return _next_queue_seq(tx.conn)


def create_attempt(tx: Tx, rollout: RolloutRow, worker_id: Optional[str]) -> Attempt:
    """R2: attempt n+1, `preparing`, owned by this session; the rollout becomes `preparing`."""
    config: RolloutConfig = rollout.config
    sequence_id = rollout.num_attempts + 1
    attempt = Attempt(
        rollout_id=rollout.rollout_id,
        attempt_id=attempt_id_for(rollout.rollout_id, sequence_id),
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
        (
            attempt.attempt_id,
            attempt.rollout_id,
            sequence_id,
            AttemptStatus.PREPARING.value,
            tx.now,
            worker_id,
            tx.session_id,
            timeout_at,
            config.unresponsive_seconds,
        ),
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
            changed.append(expire_attempt(tx, attempt_id, rollout_id, status))


def end_session(tx: Tx, session_id: str, how: rules.SessionEnd) -> list[Attempt]:
    """R7: close the session; its active attempts become unresponsive, uncharged."""
    found = tx.conn.execute("SELECT pid FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    note = rules.harness_ended_note(how, None if found is None else found["pid"])
    rows = tx.conn.execute(
        "SELECT attempt_id, rollout_id, metadata FROM attempts "
        "WHERE session_id = ? AND status IN ('preparing', 'running') ORDER BY rowid",
        (session_id,),
    ).fetchall()
    changed = []
    for attempt_id, rollout_id, metadata in rows:
        row = tx.conn.execute(
            "UPDATE attempts SET status = ?, end_time = coalesce(end_time, ?), metadata = ? "
            f"WHERE attempt_id = ? RETURNING {ATTEMPT_COLUMNS}",
            (AttemptStatus.UNRESPONSIVE.value, tx.now, dumps({**(loads_or_none(metadata) or {}), **note}), attempt_id),
        ).fetchone()
        propagate(
            tx, get_rollout(tx.conn, rollout_id, RULE_COLUMNS), row["sequence_id"], row["status"], harness_ended=True
        )
        changed.append(attempt_from_row(row))
    sessions.mark_closed(tx.conn, session_id, how)
    return changed
