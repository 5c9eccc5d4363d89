"""Store sessions: which process owns which attempts (rule R7 in rules.py).

Every writable `SqliteStore` registers a session row (`se-000001`, numbered in
the file's order like the other ids; pid, the process's start time, hostname).
Attempts record the session that owns them. A session whose process is gone —
checked by pid *and* process start time, so a recycled pid does not look alive —
is dead, and its active attempts are orphans that nobody will ever finish; the
store ends the session for it (R7: they become `unresponsive`, their rollouts
go back to the queue uncharged; txn.end_session).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
import time
from dataclasses import dataclass
from typing import Optional

import psutil

from agl.store.codec import numbered_id

# Process start times come from /proc with a resolution of clock ticks; allow
# for rounding when comparing the recorded one with the live one.
_START_TIME_TOLERANCE = 1.0


@dataclass(frozen=True)
class SessionInfo:
    session_id: Optional[str]  # None until registered
    pid: int
    process_start_time: float | None
    hostname: str


def _process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def current_session() -> SessionInfo:
    """This process, as a session still to be registered."""
    pid = os.getpid()
    return SessionInfo(
        session_id=None, pid=pid, process_start_time=_process_start_time(pid), hostname=socket.gethostname()
    )


def register(conn: sqlite3.Connection, session: SessionInfo) -> SessionInfo:
    """Insert the session (inside a write transaction) under the next free number."""
    number = conn.execute("SELECT coalesce(max(rowid), 0) + 1 FROM sessions").fetchone()[0]
    session = dataclasses.replace(session, session_id=numbered_id("se", number))
    conn.execute(
        "INSERT INTO sessions (session_id, pid, process_start_time, hostname, opened_time) VALUES (?, ?, ?, ?, ?)",
        (session.session_id, session.pid, session.process_start_time, session.hostname, time.time()),
    )
    return session


def mark_closed(conn: sqlite3.Connection, session_id: str, reason: str) -> None:
    conn.execute(
        "UPDATE sessions SET closed_time = ?, close_reason = ? WHERE session_id = ? AND closed_time IS NULL",
        (time.time(), reason, session_id),
    )


def is_alive(session: SessionInfo) -> bool:
    """Whether the session's process still runs. Sessions of other hosts count as alive:
    we cannot tell, and wrongly orphaning live work is worse than waiting for deadlines."""
    if session.hostname != socket.gethostname():
        return True
    try:
        proc = psutil.Process(session.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        started = proc.create_time()
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError):
        return True
    if session.process_start_time is None:
        return True
    return abs(started - session.process_start_time) <= _START_TIME_TOLERANCE


def find_dead(conn: sqlite3.Connection, exclude: str | None) -> list[str]:
    """Ids of open sessions (other than `exclude`) whose process has died."""
    rows = conn.execute(
        "SELECT session_id, pid, process_start_time, hostname FROM sessions WHERE closed_time IS NULL"
    ).fetchall()
    return [r[0] for r in rows if r[0] != exclude and not is_alive(SessionInfo(*r))]
