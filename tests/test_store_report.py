"""`report=<run dir>` (agl/report/run_report.py) tells harness deaths apart from agent failures:
attempts cut short by the harness's end (R7) are neither retries nor agent errors."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from store_helpers import FakeClock, abandon, pretend_dead

from agl.report.run_report import report_run
from agl.store import SqliteStore
from agl.types import RolloutConfig, Span


async def finish(store: SqliteStore, got, status: str = "succeeded", error: str | None = None) -> None:
    await store.add_span(
        Span(rollout_id=got.rollout_id, attempt_id=got.attempt.attempt_id, name="reward", attributes={"reward": 1.0})
    )
    await store.update_attempt(
        got.rollout_id, got.attempt.attempt_id, status=status, **({"metadata": {"error": error}} if error else {})
    )


async def a_run_with_two_harness_ends(path: Path) -> None:
    """Step 0: a succeeds; b fails once (the agent's fault) and is retried; c's harness is
    killed and d's closed with them in flight, and both are rerun."""
    clock = FakeClock()
    store = SqliteStore(path, clock=clock, watchdog_interval=None)
    try:
        a, b, c, d = await store.enqueue_rollouts(
            list("abcd"), metadata={"step": 0}, config=RolloutConfig(max_attempts=2, retry_condition=["failed"])
        )
        await finish(store, await store.dequeue_rollout())
        await finish(store, await store.dequeue_rollout(), "failed", "ValueError: bad answer\ntraceback...")
        for how in ("dead", "closed"):
            runner = SqliteStore(path, clock=clock, watchdog_interval=None)
            await runner.dequeue_rollout()
            if how == "dead":
                abandon(runner)
                pretend_dead(path, runner.session_id)
                await store.reap_dead_sessions()
            else:
                await runner.close()
        while (got := await store.dequeue_rollout()) is not None:
            await finish(store, got)
    finally:
        await store.close()


def test_report_counts_harness_ends_apart(tmp_path: Path):
    asyncio.run(a_run_with_two_harness_ends(tmp_path / "store.sqlite"))
    conn = sqlite3.connect(tmp_path / "store.sqlite")
    assert conn.execute("SELECT step, rollouts, succeeded, retried, interrupted FROM step_summary").fetchall() == [
        (0, 4, 4, 1, 2)
    ]
    assert conn.execute("SELECT harness_ended, count(*) FROM attempt_durations GROUP BY 1 ORDER BY 1").fetchall() == [
        (None, 5),
        ("closed", 1),
        ("dead", 1),
    ]
    conn.close()

    report_run(tmp_path, echo=False)
    text = (tmp_path / "report.md").read_text()
    assert "| attempts  | 7 (1 retries after agent failures, 2 interrupted by the harness dying or closing) |" in text
    failures = text.split("## failures by error", 1)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in failures.splitlines() if line.startswith("|")]
    assert rows[2:] == [
        ["failed", "ValueError: bad answer", "1"],
        ["unresponsive", "the harness closed with it in flight (not the agent's failure: rerun, no retry used)", "1"],
        ["unresponsive", "the harness died (not the agent's failure: rerun, no retry used)", "1"],
    ]
