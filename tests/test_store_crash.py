"""Crash safety: SIGKILL a writer at a random moment, reopen, check everything.

The child (tests/store_worker.py) loops enqueue / dequeue / add_span / finish
and prints a line after each commit. After `kill -9` we reopen the file and
require: integrity_check ok, every reported commit present, every rollout's
status consistent with its latest attempt, batches all-or-nothing, and the
dead process's open attempts turned `unresponsive` with the harness-ended note
and their rollouts requeued without using up a retry (R7), max_attempts=1
included: a kill -9 of the harness never fails a rollout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

from store_helpers import PYTHON, REPO, WORKER, check_invariants

from agl.store import SqliteStore


class Child:
    """A worker subprocess whose stdout lines are collected by a thread."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [PYTHON, str(WORKER), *args], cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, count: int, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while len(self.lines) < count:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited early with {self.proc.returncode}: {self.lines[-3:]}")
            if time.monotonic() > end:
                raise AssertionError(f"worker too slow: {len(self.lines)} lines")
            time.sleep(0.002)

    def kill(self) -> list[str]:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._thread.join(timeout=10)
        return [line for line in self.lines if line and line[0] in "EDSFC"]


def check_reported_commits(path: Path, events: list[str]) -> None:
    conn = sqlite3.connect(path)
    try:
        rollouts = {r[0] for r in conn.execute("SELECT rollout_id FROM rollouts")}
        attempts = dict(conn.execute("SELECT attempt_id, status FROM attempts"))
        spans = set(conn.execute("SELECT rollout_id, sequence_id FROM spans"))
        dequeued: list[str] = []
        finished: set[str] = set()
        for event in events:
            kind, *args = event.split()
            if kind == "E":
                assert args[0] in rollouts, f"lost enqueue {args[0]}"
            elif kind == "D":
                assert args[1] in attempts, f"lost dequeue {args[1]}"
                dequeued.append(args[1])
            elif kind == "S":
                assert (args[0], int(args[1])) in spans, f"lost span {args}"
            elif kind == "F":
                assert attempts[args[1]] == args[2], f"lost finish {args}"
                finished.add(args[1])
        # Attempts left open by the dead process are now unresponsive; only the
        # very last one may have been finished by a commit it had no time to report.
        open_ones = [a for a in dequeued if a not in finished]
        not_reaped = [a for a in open_ones if attempts[a] != "unresponsive"]
        assert len(not_reaped) <= 1 and (not not_reaped or not_reaped[0] == dequeued[-1]), not_reaped
        # enqueue_rollouts batches are all-or-nothing.
        sizes = conn.execute(
            "SELECT count(*) FROM rollouts WHERE json_extract(metadata, '$.batch') IS NOT NULL "
            "GROUP BY json_extract(metadata, '$.batch')"
        ).fetchall()
        assert all(n == 5 for (n,) in sizes), sizes
    finally:
        conn.close()


def in_flight(path: Path, session_id: str) -> dict[str, int]:
    """{attempt_id: the rollout's max_attempts} for the session's active attempts."""
    conn = sqlite3.connect(path)
    try:
        return {
            attempt_id: json.loads(config)["max_attempts"]
            for attempt_id, config in conn.execute(
                "SELECT a.attempt_id, r.config FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
                "WHERE a.session_id = ? AND a.status IN ('preparing', 'running')",
                (session_id,),
            )
        }
    finally:
        conn.close()


def check_killed_attempts_not_charged(path: Path, killed: dict[str, int], pid: int) -> None:
    """R7 after kill -9: the attempts in flight ended with the note, their rollouts requeued."""
    conn = sqlite3.connect(path)
    try:
        for attempt_id in killed:
            status, metadata, rollout_status = conn.execute(
                "SELECT a.status, a.metadata, r.status FROM attempts a JOIN rollouts r ON r.rollout_id = a.rollout_id "
                "WHERE a.attempt_id = ?",
                (attempt_id,),
            ).fetchone()
            note = json.loads(metadata)
            assert (status, note["harness_ended"], rollout_status) == ("unresponsive", "dead", "requeuing"), attempt_id
            assert f"(pid {pid}) died" in note["error"]
        # No rollout failed because of a kill: a failed one's latest attempt failed itself.
        bad = conn.execute(
            "SELECT rollout_id, attempt_status FROM latest_attempts "
            "WHERE rollout_status = 'failed' AND attempt_status != 'failed'"
        ).fetchall()
        assert not bad, bad
    finally:
        conn.close()


def test_sigkill_during_writes_loses_nothing_committed(tmp_path: Path):
    path = tmp_path / "store.sqlite"
    rng = random.Random(1234)
    killed_single_try = 0  # killed attempts of rollouts with max_attempts=1: each would have failed before R7
    for round_ in range(4):
        child = Child("crash", str(path), str(round_))
        child.wait_for(1)
        dead_session = child.lines[0].split()[1]
        child.wait_for(rng.randint(40, 200))
        time.sleep(rng.uniform(0, 0.03))  # land anywhere, mid-transaction included
        events = child.kill()
        assert events
        killed = in_flight(path, dead_session)
        killed_single_try += sum(1 for n in killed.values() if n == 1)

        async def reopen() -> None:
            store = SqliteStore(path, watchdog_interval=None)  # reaps the dead session (R7)
            try:
                conn = sqlite3.connect(path)
                closed = conn.execute(
                    "SELECT close_reason FROM sessions WHERE session_id = ?", (dead_session,)
                ).fetchone()
                active = conn.execute(
                    "SELECT count(*) FROM attempts WHERE session_id = ? AND status IN ('preparing', 'running')",
                    (dead_session,),
                ).fetchone()[0]
                conn.close()
                assert closed == ("dead",) and active == 0
                check_killed_attempts_not_charged(path, killed, child.proc.pid)
                # The store is usable: drain the queue; the dead process's requeued
                # rollouts come back as their next attempt.
                requeued = {r.rollout_id for r in await store.query_rollouts(status="requeuing")}
                while (got := await store.dequeue_rollout()) is not None:
                    if got.rollout_id in requeued:
                        assert got.attempt.sequence_id >= 2
                        requeued.discard(got.rollout_id)
                    await store.update_attempt(got.rollout_id, "latest", status="succeeded")
                assert not requeued
            finally:
                await store.close()

        # Consistent as left by the kill, before any recovery ...
        assert check_invariants(path) == []
        asyncio.run(reopen())
        # ... and after recovery, with nothing committed lost.
        check_reported_commits(path, events)
        assert check_invariants(path) == []
    assert killed_single_try > 0, "the kills should have caught rollouts with max_attempts=1 in flight"


def test_sigkill_during_checkpoint_keeps_a_whole_checkpoint(tmp_path: Path):
    path = tmp_path / "store.sqlite"
    rng = random.Random(99)
    last_reported = 0
    for _ in range(2):
        child = Child("checkpoint", str(path))
        child.wait_for(3)  # "ready" and two checkpoints
        time.sleep(rng.uniform(0, 0.05))
        reported = [int(e.split()[1]) for e in child.kill() if e.startswith("C")]
        last_reported = max(reported + [last_reported])

        async def check() -> None:
            store = SqliteStore.open_readonly(path)
            try:
                ckpt = await store.load_checkpoint()
                assert ckpt is not None and ckpt.step >= last_reported
                assert hashlib.sha256(ckpt.blobs["adapter"]).hexdigest() == ckpt.state["sha"]
                assert ckpt.blobs["optimizer"] == ckpt.blobs["adapter"][:1000]
                assert ckpt.state["cursor"] == ckpt.step * 8 and ckpt.metrics == {"loss": 1.0 / ckpt.step}
            finally:
                await store.close()

        asyncio.run(check())
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    kept = conn.execute("SELECT count(DISTINCT step) FROM checkpoint_blobs").fetchone()[0]
    assert kept <= 2
    conn.close()


def test_reader_alongside_crashing_writer(tmp_path: Path):
    """A read-only reader keeps working next to a busy writer, and after it dies."""
    path = tmp_path / "store.sqlite"
    child = Child("crash", str(path), "7")
    child.wait_for(30)

    async def read() -> int:
        store = SqliteStore.open_readonly(path)
        try:
            n = 0
            for _ in range(20):
                n = len(await store.query_rollouts())
                await asyncio.sleep(0.005)
            return n
        finally:
            await store.close()

    assert asyncio.run(read()) > 0
    child.kill()
    assert asyncio.run(read()) > 0
