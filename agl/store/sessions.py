"""Store sessions: which process owns which attempts (rule R7 in rules.py).

Every writable `SqliteStore` registers a session row (`se-000001`, numbered in
the file's order like the other ids; pid, the process's start time, hostname).
Attempts record the session that owns them. A session whose process is gone —
checked by pid *and* process start time, so a recycled pid does not look alive —
is dead, and its active attempts are orphans that nobody will ever finish; the
store ends the session for it (R7: they become `unresponsive`, their rollouts
go back to the queue uncharged; txn.end_session).

A client of a store served over HTTP (agl/store/server.py) has a session of its own,
opened for it by the server: its process runs on any host, so its pid says nothing
here. It is alive while it heartbeats: each heartbeat moves `heartbeat_time`, and once
`heartbeat_seconds` pass without one (the store's clock) the session is dead and is
ended like a dead process's. A write made for a session that has ended is refused
(`SessionEnded`): its attempts went back to the queue, so what it reports about them
no longer counts.
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


class SessionEnded(RuntimeError):
    """A write for a store session that has ended (closed, or found dead: its heartbeats stopped). Nothing
    of the write was done; the session's attempts went back to the queue uncharged (R7)."""


@dataclass(frozen=True)
class SessionInfo:
    session_id: Optional[str]  # None until registered
    pid: int
    process_start_time: float | None
    hostname: str
    heartbeat_seconds: float | None = None  # a client's session: alive while it heartbeats
    heartbeat_time: float | None = None


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
        "INSERT INTO sessions (session_id, pid, process_start_time, hostname, opened_time, heartbeat_seconds, "
        "heartbeat_time) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            session.session_id,
            session.pid,
            session.process_start_time,
            session.hostname,
            time.time(),
            session.heartbeat_seconds,
            session.heartbeat_time,
        ),
    )
    return session


def heartbeat(conn: sqlite3.Connection, session_id: str, now: float) -> bool:
    """A client session's heartbeat (inside a write transaction); False if it has ended (or never existed)."""
    return (
        conn.execute(
            "UPDATE sessions SET heartbeat_time = ? WHERE session_id = ? AND closed_time IS NULL", (now, session_id)
        ).rowcount
        == 1
    )


def require_open(conn: sqlite3.Connection, session_id: str) -> None:
    """`SessionEnded` unless the session is open (one primary-key probe, inside the write that acts for it)."""
    row = conn.execute("SELECT closed_time, close_reason FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    if row is None:
        raise SessionEnded(f"store session {session_id} does not exist")
    if row[0] is not None:
        raise SessionEnded(f"store session {session_id} has ended ({row[1]}): its attempts went back to the queue")


def renew_leases(conn: sqlite3.Connection, now: float) -> None:
    """Every open client session's heartbeat counts from now (inside a write transaction): a store server
    that starts again gives its clients a whole deadline to find it, as it was the one away."""
    conn.execute(
        "UPDATE sessions SET heartbeat_time = ? WHERE closed_time IS NULL AND heartbeat_seconds IS NOT NULL", (now,)
    )


def mark_closed(conn: sqlite3.Connection, session_id: str, reason: str) -> None:
    conn.execute(
        "UPDATE sessions SET closed_time = ?, close_reason = ? WHERE session_id = ? AND closed_time IS NULL",
        (time.time(), reason, session_id),
    )


def is_alive(session: SessionInfo, now: float) -> bool:
    """Whether the session's process still runs, or, for a client's session, whether its last heartbeat is
    within `heartbeat_seconds` of `now`. Process sessions of other hosts count as alive: we cannot tell, and
    wrongly orphaning live work is worse than waiting for deadlines."""
    if session.heartbeat_seconds is not None:
        return (session.heartbeat_time or 0.0) + session.heartbeat_seconds > now
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


SESSION_COLUMNS = "session_id, pid, process_start_time, hostname, heartbeat_seconds, heartbeat_time"


def find(conn: sqlite3.Connection, session_id: str) -> Optional[SessionInfo]:
    """The open session `session_id`, or None (closed or unknown)."""
    row = conn.execute(
        f"SELECT {SESSION_COLUMNS} FROM sessions WHERE session_id = ? AND closed_time IS NULL", (session_id,)
    ).fetchone()
    return None if row is None else SessionInfo(*row)


def find_dead(conn: sqlite3.Connection, exclude: str | None, now: float) -> list[str]:
    """Ids of open sessions (other than `exclude`) whose process has died or whose heartbeats stopped."""
    rows = conn.execute(f"SELECT {SESSION_COLUMNS} FROM sessions WHERE closed_time IS NULL").fetchall()
    return [r[0] for r in rows if r[0] != exclude and not is_alive(SessionInfo(*r), now)]
