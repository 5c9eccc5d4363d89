"""Helpers shared by the store tests: a controllable clock and an invariant checker.

The checker reads the file with plain `sqlite3` (not through the store) and
re-derives the status rules independently of `agl/store/rules.py`, so a bug
in the rules module cannot hide itself.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
WORKER = Path(__file__).resolve().parent / "store_worker.py"

TERMINAL = {"succeeded", "failed", "cancelled"}
QUEUED = {"queuing", "requeuing"}
ACTIVE = {"preparing", "running"}


class FakeClock:
    """A clock tests move by hand: `SqliteStore(path, clock=FakeClock())`."""

    def __init__(self, start: float = 1_000_000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def pretend_dead(path: Path | str, session_id: str) -> None:
    """Make a session look like its process died: point it at a pid that cannot exist (a client's session:
    its last heartbeat long ago)."""
    conn = sqlite3.connect(path)
    try:
        conn.execute(
            "UPDATE sessions SET pid = 999999999, heartbeat_time = CASE WHEN heartbeat_seconds IS NULL THEN NULL "
            "ELSE -1e18 END WHERE session_id = ?",
            (session_id,),
        )
        conn.commit()
    finally:
        conn.close()


def client_of(store, **kwargs):
    """A `StoreClient` of `store` served in this process (agl/store/server.py's app through httpx's ASGI
    transport, no socket): the client side of the behaviour suite, on the suite's file and fake clock. Its
    session's heartbeat deadline is far, on the fake clock and the real one (a test of the deadline sets its own)."""
    import httpx

    from agl.store import StoreClient
    from agl.store.server import StoreServer

    server = StoreServer(store, session_timeout=kwargs.pop("session_timeout", 1e12))
    kwargs.setdefault("heartbeat_interval", 3600.0)
    return StoreClient("http://store", transport=httpx.ASGITransport(app=server.app), **kwargs)


def abandon(store) -> None:
    """Drop a store the way kill -9 would: its connection and thread go, its session
    stays open in the file (for the next store to find dead, rule R7). A client: it stops
    heartbeating and never closes its session (for its deadline to end it)."""
    if hasattr(store, "_wire"):
        if store._heartbeat is not None:
            store._heartbeat.cancel()
        store._wire.closed = True
        return
    store._closed = True
    store._worker.call(store._close_connection)
    store._worker.shutdown()


def derive_rollout_status(attempt_status: str, charged: int, config: dict, harness_ended: bool = False) -> str:
    """The rollout status the latest attempt implies (independent copy of rules R4/R7).

    `charged`: the rollout's attempts not cut short by a harness's end, the latest
    included; `harness_ended`: the latest attempt was (its rollout is requeued free)."""
    if attempt_status in ("preparing", "running", "succeeded"):
        return attempt_status
    if harness_ended:
        return "requeuing"
    if attempt_status in config.get("retry_condition", []) and charged < config.get("max_attempts", 1):
        return "requeuing"
    return "failed"


def harness_ended(metadata_json: Optional[str]) -> Optional[str]:
    """The R7 note of an attempt's raw metadata: 'dead' | 'closed' | None."""
    return (json.loads(metadata_json) or {}).get("harness_ended") if metadata_json else None


def check_invariants(path: Path | str, *, explicit_updates: bool = False) -> list[str]:
    """Return the violated invariants of the store file (empty list: all good).

    With explicit_updates=False (no update_rollout(status=...) was ever made),
    every non-terminal rollout's status must equal the one its latest attempt
    implies, and every failed/succeeded rollout must be backed by its latest attempt.
    """
    problems: list[str] = []
    conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    try:
        ok = conn.execute("PRAGMA integrity_check").fetchone()[0]
        if ok != "ok":
            problems.append(f"integrity_check: {ok}")
        fk = conn.execute("PRAGMA foreign_key_check").fetchall()
        if fk:
            problems.append(f"foreign_key_check: {fk[:3]}")
        rollouts = conn.execute(
            "SELECT rollout_id, status, config, end_time, num_attempts, queue_seq, last_span_seq FROM rollouts"
        ).fetchall()
        attempts: dict[str, list[tuple]] = {}
        for row in conn.execute(
            "SELECT rollout_id, sequence_id, status, end_time, session_id, metadata FROM attempts "
            "ORDER BY rollout_id, sequence_id"
        ):
            attempts.setdefault(row[0], []).append(row)
        closed_sessions = {r[0] for r in conn.execute("SELECT session_id FROM sessions WHERE closed_time IS NOT NULL")}
        max_span_seq = dict(conn.execute("SELECT rollout_id, max(sequence_id) FROM spans GROUP BY rollout_id"))
        queue_seqs = [r[5] for r in rollouts if r[5] is not None]
        if len(queue_seqs) != len(set(queue_seqs)):
            problems.append("duplicate queue positions")
        for rid, status, config_json, end_time, num_attempts, queue_seq, last_span_seq in rollouts:
            config = json.loads(config_json)
            atts = attempts.get(rid, [])
            if [a[1] for a in atts] != list(range(1, len(atts) + 1)) or len(atts) != num_attempts:
                problems.append(f"{rid}: attempts {[a[1] for a in atts]} vs num_attempts {num_attempts}")
            if (queue_seq is not None) != (status in QUEUED):
                problems.append(f"{rid}: status {status} with queue_seq {queue_seq}")
            if (end_time is not None) != (status in TERMINAL):
                problems.append(f"{rid}: status {status} with end_time {end_time}")
            if max_span_seq.get(rid, 0) > last_span_seq:
                problems.append(f"{rid}: span sequence {max_span_seq[rid]} > issued {last_span_seq}")
            for a in atts:
                if a[2] in ACTIVE and a[4] in closed_sessions:
                    problems.append(f"{rid}: attempt {a[1]} is {a[2]} but its session ended")
                if (a[3] is None) != (a[2] in ACTIVE):
                    problems.append(f"{rid}: attempt {a[1]} {a[2]} with end_time {a[3]}")
                if harness_ended(a[5]) and (a[2] != "unresponsive" or a[4] not in closed_sessions):
                    problems.append(f"{rid}: attempt {a[1]} {a[2]} has a harness-ended note, session {a[4]}")
            if explicit_updates:
                continue
            latest: Optional[tuple] = atts[-1] if atts else None
            if latest is None:
                if status != "queuing":
                    problems.append(f"{rid}: {status} without attempts")
                continue
            charged = sum(1 for a in atts if not harness_ended(a[5]))
            implied = derive_rollout_status(latest[2], charged, config, bool(harness_ended(latest[5])))
            if status not in TERMINAL and status != implied:
                problems.append(f"{rid}: status {status}, latest attempt {latest[2]} implies {implied}")
            if status in ("succeeded", "failed") and status != implied:
                problems.append(f"{rid}: {status} but latest attempt {latest[2]} implies {implied}")
    finally:
        conn.close()
    return problems
