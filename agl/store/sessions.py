"""Store sessions: which process owns which attempts (rule R7 in rules.py).

Every writable `SqliteStore` registers a session row (uuid, pid, the process's
start time, hostname). Attempts record the session that created them. A
session whose process is gone — checked by pid *and* process start time, so a
recycled pid does not look alive — is dead, and its active attempts are
orphans that nobody will ever finish; the store marks them `unresponsive`.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
import uuid
from dataclasses import dataclass

import psutil

# Process start times come from /proc with a resolution of clock ticks; allow
# for rounding when comparing the recorded one with the live one.
_START_TIME_TOLERANCE = 1.0


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    pid: int
    process_start_time: float | None
    hostname: str


def _process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def current_session() -> SessionInfo:
    pid = os.getpid()
    return SessionInfo(
        session_id="se-" + uuid.uuid4().hex[:16],
        pid=pid,
        process_start_time=_process_start_time(pid),
        hostname=socket.gethostname(),
    )


def register(conn: sqlite3.Connection, session: SessionInfo) -> None:
    conn.execute(
        "INSERT INTO sessions (session_id, pid, process_start_time, hostname, opened_time) "
        "VALUES (?, ?, ?, ?, ?)",
        (session.session_id, session.pid, session.process_start_time, session.hostname, time.time()),
    )


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
