"""Deadlines on every read (R6), and reading files of an older schema.

A writable store applies due deadlines before every read, so no caller sees an
attempt past its deadline as `preparing`/`running`. A read-only store cannot
write: it shows the same statuses without touching the file.
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from store_helpers import FakeClock, check_invariants

from agl.store import SqliteStore, db
from agl.types import RolloutConfig, Span

asyncio_test = pytest.mark.asyncio
TIMEOUT_RETRY = RolloutConfig(timeout_seconds=5, max_attempts=2, retry_condition=["timeout"])
SILENT_ONCE = RolloutConfig(unresponsive_seconds=3)


def in_file(path: Path, rollout_id: str) -> tuple[str, str]:
    """(rollout status, latest attempt status) as stored, read with plain sqlite3."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(
            "SELECT rollout_status, attempt_status FROM latest_attempts WHERE rollout_id = ?", (rollout_id,)
        ).fetchone()
    finally:
        conn.close()


READS = {
    "query_rollouts": lambda s, rid: s.query_rollouts(),
    "query_rollouts(status=)": lambda s, rid: s.query_rollouts(status="running"),
    "get_rollout_by_id": lambda s, rid: s.get_rollout_by_id(rid),
    "query_attempts": lambda s, rid: s.query_attempts(rid),
    "get_latest_attempt": lambda s, rid: s.get_latest_attempt(rid),
    "query_spans": lambda s, rid: s.query_spans(rid),
    "get_latest_resources": lambda s, rid: s.get_latest_resources(),
    "load_checkpoint": lambda s, rid: s.load_checkpoint(),
}


@asyncio_test
@pytest.mark.parametrize("read", list(READS))
async def test_every_read_of_a_writable_store_applies_due_deadlines(
    store: SqliteStore, path: Path, clock: FakeClock, read: str
):
    r = await store.enqueue_rollout("x", config=TIMEOUT_RETRY)
    a = await store.dequeue_rollout()
    await store.add_span(Span(rollout_id=r.rollout_id, attempt_id=a.attempt.attempt_id, name="llm.chat"))
    clock.advance(5)
    assert in_file(path, r.rollout_id) == ("running", "running")
    result = await READS[read](store, r.rollout_id)
    assert in_file(path, r.rollout_id) == ("requeuing", "timeout")  # expired by the read itself
    if read == "query_rollouts(status=)":
        assert result == []
    if read == "get_latest_attempt":
        assert result.status == "timeout" and result.end_time == clock.now


@asyncio_test
async def test_read_only_store_shows_deadlines_without_writing(store: SqliteStore, path: Path, clock: FakeClock):
    retried = await store.enqueue_rollout("retried", config=TIMEOUT_RETRY)
    silent = await store.enqueue_rollout("silent", config=SILENT_ONCE)
    cancelled = await store.enqueue_rollout("cancelled", config=SILENT_ONCE)
    calm = await store.enqueue_rollout("calm")
    for _ in range(4):
        await store.dequeue_rollout()
    cancelled = await store.update_rollout(cancelled.rollout_id, status="cancelled")
    ids = [r.rollout_id for r in (retried, silent, cancelled, calm)]
    reader = SqliteStore.open_readonly(path, clock=clock)
    try:
        assert [r.status for r in await reader.query_rollouts()] == ["preparing", "preparing", "cancelled", "preparing"]
        clock.advance(6)
        stored = [in_file(path, rid) for rid in ids]

        shown = await reader.query_rollouts()
        assert [r.status for r in shown] == ["requeuing", "failed", "cancelled", "preparing"]
        assert [r.end_time for r in shown] == [None, clock.now, cancelled.end_time, None]
        assert [r.rollout_id for r in await reader.query_rollouts(status="preparing")] == [calm.rollout_id]
        assert [r.rollout_id for r in await reader.query_rollouts(status=["failed", "requeuing"])] == ids[:2]
        assert (await reader.get_rollout_by_id(silent.rollout_id)).status == "failed"
        latest = [await reader.get_latest_attempt(rid) for rid in ids]
        assert [a.status for a in latest] == ["timeout", "unresponsive", "unresponsive", "preparing"]
        assert latest[0].end_time == clock.now and latest[3].end_time is None
        assert [a.status for a in await reader.query_attempts(retried.rollout_id)] == ["timeout"]
        done = await reader.wait_for_rollouts(ids, timeout=0)
        assert [(r.rollout_id, r.status) for r in done] == [
            (silent.rollout_id, "failed"),
            (cancelled.rollout_id, "cancelled"),
        ]

        assert [in_file(path, rid) for rid in ids] == stored  # nothing was written
        assert stored[0] == ("preparing", "preparing")
        # The writer, applying the deadlines for real, agrees with what the reader showed.
        await store.check_timeouts()
        assert [(r.status, r.end_time) for r in await store.query_rollouts()] == [(r.status, r.end_time) for r in shown]
        assert [(await store.get_latest_attempt(rid)).status for rid in ids] == [a.status for a in latest]
    finally:
        await reader.close()
    assert check_invariants(path, explicit_updates=True) == []


@asyncio_test
async def test_read_only_waiter_sees_a_deadline_pass_without_any_commit(
    store: SqliteStore, path: Path, clock: FakeClock
):
    r = await store.enqueue_rollout("x", config=SILENT_ONCE)
    await store.dequeue_rollout()
    reader = SqliteStore.open_readonly(path, clock=clock, poll_interval=0.02)
    try:
        waiter = asyncio.create_task(reader.wait_for_rollouts([r.rollout_id], timeout=10))
        await asyncio.sleep(0.05)
        clock.advance(3)  # no process commits anything
        [done] = await asyncio.wait_for(waiter, 2)
        assert done.status == "failed"
    finally:
        await reader.close()
    assert in_file(path, r.rollout_id) == ("preparing", "preparing")


# -- schema versions ---------------------------------------------------------------------

V1_STEP_SUMMARY = """CREATE VIEW step_summary AS
SELECT step, count(*) AS rollouts, sum(status = 'succeeded') AS succeeded, sum(status = 'failed') AS failed,
       sum(status = 'cancelled') AS cancelled, sum(status NOT IN ('succeeded', 'failed', 'cancelled')) AS unfinished,
       sum(num_attempts > 1) AS retried, count(reward) AS rewarded, avg(reward) AS mean_reward,
       min(reward) AS min_reward, max(reward) AS max_reward, min(start_time) AS first_start, max(end_time) AS last_end
FROM rollout_rewards WHERE step IS NOT NULL GROUP BY step"""


def make_version_1(path: Path) -> None:
    """Turn a store file into what version-1 code left: version 1, its step_summary view."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript(f"BEGIN; DROP VIEW step_summary; {V1_STEP_SUMMARY}; PRAGMA user_version=1; COMMIT;")
    conn.close()


def step_summary_columns(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [row[1] for row in conn.execute("PRAGMA table_info(step_summary)")]
    finally:
        conn.close()


@asyncio_test
async def test_version_1_files_are_read_as_they_are_and_upgraded_by_a_writer(path: Path):
    store = SqliteStore(path, watchdog_interval=None)
    r = await store.enqueue_rollout("x", metadata={"step": 0})
    await store.close()
    make_version_1(path)
    assert "interrupted" not in step_summary_columns(path)

    reader = SqliteStore.open_readonly(path)
    assert [x.rollout_id for x in await reader.query_rollouts(step=0)] == [r.rollout_id]
    await reader.close()

    writer = SqliteStore(path, watchdog_interval=None)
    await writer.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == db.SCHEMA_VERSION == 2
    assert conn.execute("SELECT step, rollouts, retried, interrupted FROM step_summary").fetchall() == [(0, 1, 0, 0)]
    conn.execute("PRAGMA user_version=99")
    conn.commit()
    conn.close()
    for open_ in (lambda: SqliteStore(path, watchdog_interval=None), lambda: SqliteStore.open_readonly(path)):
        with pytest.raises(RuntimeError, match="version 99"):
            open_()
