"""Rules R4/R7: a harness that dies or closes under its attempts costs the agent nothing.

The attempts in flight become `unresponsive` with a harness-ended note and are not
charged: their rollouts go back to the queue whatever `max_attempts` says, and the
retry budget counts only the agent's own tries. `charged_attempt_number` gives a
rerun the number of the try it replaces (the model route seeds sampling with it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import FakeClock, abandon, check_invariants, pretend_dead

from agl.store import SqliteStore
from agl.store.rules import charged_attempt_number, is_harness_ended, rollout_status_for_attempt
from agl.types import Attempt, AttemptStatus, RolloutConfig, RolloutStatus, Span

asyncio_test = pytest.mark.asyncio
SINGLE_TRY = RolloutConfig()  # max_attempts=1, no retry_condition


def harness(path: Path, clock: FakeClock) -> SqliteStore:
    """Another harness process on the same file (its own session)."""
    return SqliteStore(path, clock=clock, watchdog_interval=None)


async def dies(runner: SqliteStore, store: SqliteStore) -> None:
    """`runner`'s process is killed; `store` notices (as the watchdog or a reopen would)."""
    abandon(runner)
    pretend_dead(runner.path, runner.session_id)
    await store.reap_dead_sessions()


# -- the pure rules ---------------------------------------------------------------


def test_rollout_status_for_attempt_counts_charged_attempts_only():
    cfg = RolloutConfig(max_attempts=2, retry_condition=["failed", "unresponsive"])
    assert rollout_status_for_attempt(AttemptStatus.FAILED, 1, cfg) == RolloutStatus.REQUEUING
    assert rollout_status_for_attempt(AttemptStatus.FAILED, 2, cfg) == RolloutStatus.FAILED
    assert rollout_status_for_attempt(AttemptStatus.TIMEOUT, 1, cfg) == RolloutStatus.FAILED  # not retried
    # R7: whatever the budget and retry_condition say.
    for charged in (1, 2, 5):
        assert (
            rollout_status_for_attempt(AttemptStatus.UNRESPONSIVE, charged, SINGLE_TRY, harness_ended=True)
            == "requeuing"
        )
    assert rollout_status_for_attempt(AttemptStatus.RUNNING, 9, cfg) == RolloutStatus.RUNNING


def test_charged_attempt_number_skips_harness_deaths():
    def attempt(seq: int, ended: bool = False) -> Attempt:
        meta = {"harness_ended": "dead", "error": "..."} if ended else {"error": "agent"}
        return Attempt(
            rollout_id="ro-000001", attempt_id=f"at-000001-{seq}", sequence_id=seq, start_time=0.0, metadata=meta
        )

    attempts = [attempt(1, True), attempt(2), attempt(3, True), attempt(4, True), attempt(5)]
    assert [is_harness_ended(a) for a in attempts] == [True, False, True, True, False]
    # 1 for the first agent try; the reruns after deaths keep the number of the try they replace.
    assert [charged_attempt_number(attempts, a) for a in attempts] == [1, 1, 2, 2, 2]
    assert charged_attempt_number(attempts[::-1], attempts[4]) == 2  # order does not matter
    assert not is_harness_ended(Attempt(rollout_id="r", attempt_id="a", sequence_id=1, start_time=0.0))


# -- the store --------------------------------------------------------------------


@asyncio_test
async def test_dead_harness_requeues_even_a_single_try_rollout(store: SqliteStore, path: Path, clock: FakeClock):
    r = await store.enqueue_rollout("x", config=SINGLE_TRY)
    runner = harness(path, clock)
    got = await runner.dequeue_rollout(worker_id="w")
    await runner.update_attempt(r.rollout_id, "latest", metadata={"trace": "kept"})
    await dies(runner, store)

    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    [attempt] = await store.query_attempts(r.rollout_id)
    assert attempt.status == "unresponsive" and attempt.end_time == clock.now and is_harness_ended(attempt)
    assert attempt.metadata == {
        "trace": "kept",  # merged into, not replaced
        "harness_ended": "dead",
        "error": "the harness process (pid 999999999) died while this attempt ran",  # pretend_dead's pid
    }
    # The rerun is attempt 2 but still the agent's first try.
    again = await store.dequeue_rollout()
    assert again.attempt.attempt_id != got.attempt.attempt_id and again.attempt.sequence_id == 2
    assert charged_attempt_number(await store.query_attempts(r.rollout_id), again.attempt) == 1
    await store.update_attempt(r.rollout_id, "latest", status="failed")  # the agent's own failure is charged
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"
    assert check_invariants(path) == []


@asyncio_test
async def test_two_harness_deaths_and_an_agent_failure_leave_a_retry(store: SqliteStore, path: Path, clock: FakeClock):
    r = await store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    for _ in range(2):
        runner = harness(path, clock)
        assert (await runner.dequeue_rollout()).rollout_id == r.rollout_id
        await dies(runner, store)
        assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    third = await store.dequeue_rollout()
    assert third.attempt.sequence_id == 3
    await store.update_attempt(r.rollout_id, "latest", status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"  # 1 charged try of 2
    fourth = await store.dequeue_rollout()
    attempts = await store.query_attempts(r.rollout_id)
    assert [charged_attempt_number(attempts, a) for a in attempts] == [1, 1, 1, 2]
    await store.update_attempt(r.rollout_id, fourth.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"  # now the budget is spent
    assert check_invariants(path) == []


@asyncio_test
async def test_close_does_not_charge_attempts_in_flight(path: Path, clock: FakeClock):
    store = SqliteStore(path, clock=clock, watchdog_interval=None)
    rs = await store.enqueue_rollouts(["a", "b", "c"], config=SINGLE_TRY)
    for _ in rs:
        await store.dequeue_rollout()
    await store.update_attempt(rs[2].rollout_id, "latest", status="succeeded")
    cancelled = await store.update_rollout(rs[1].rollout_id, status="cancelled")
    await store.close()

    reopened = SqliteStore(path, clock=clock, watchdog_interval=None)
    try:
        statuses = [(await reopened.get_rollout_by_id(r.rollout_id)).status for r in rs]
        assert statuses == ["requeuing", "cancelled", "succeeded"]  # a terminal rollout stays so (R5)
        notes = [(await reopened.get_latest_attempt(r.rollout_id)).metadata for r in rs]
        assert [(n or {}).get("harness_ended") for n in notes] == ["closed", "closed", None]
        assert "closed its store" in notes[0]["error"]
        assert (await reopened.get_rollout_by_id(rs[1].rollout_id)).end_time == cancelled.end_time
        assert (await reopened.dequeue_rollout()).rollout_id == rs[0].rollout_id
    finally:
        await reopened.close()
    assert check_invariants(path) == []


@asyncio_test
async def test_ended_sessions_requeue_in_attempt_creation_order(store: SqliteStore, path: Path, clock: FakeClock):
    runner = harness(path, clock)
    started = [await runner.start_rollout(i, config=SINGLE_TRY) for i in range(3)]
    await dies(runner, store)
    order = [(await store.dequeue_rollout()).rollout_id for _ in started]
    assert order == [s.rollout_id for s in started]


@asyncio_test
async def test_a_revived_attempt_counts_again_and_changes_owner(store: SqliteStore, path: Path, clock: FakeClock):
    r = await store.enqueue_rollout(
        "x", config=RolloutConfig(max_attempts=2, retry_condition=["unresponsive", "failed"])
    )
    runner = harness(path, clock)
    got = await runner.dequeue_rollout()
    await runner.close()
    assert is_harness_ended(await store.get_latest_attempt(r.rollout_id))
    # Its worker was alive after all (another process): its span revives the attempt (R3),
    # which drops the note and passes the attempt to the session that revived it.
    await store.add_span(Span(rollout_id=r.rollout_id, attempt_id=got.attempt.attempt_id, name="llm.chat"))
    revived = await store.get_latest_attempt(r.rollout_id)
    assert revived.status == "running" and revived.session_id == store.session_id
    assert revived.metadata is not None and not is_harness_ended(revived) and "error" not in revived.metadata
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "running"
    await store.update_attempt(r.rollout_id, "latest", status="failed")  # charged: try 1 of 2
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    assert check_invariants(path) == []


@asyncio_test
async def test_deadline_failures_are_still_charged(store: SqliteStore, clock: FakeClock):
    """Only a harness's end is free: a silent agent uses up its tries as before."""
    r = await store.enqueue_rollout(
        "x", config={"unresponsive_seconds": 1, "max_attempts": 2, "retry_condition": ["unresponsive"]}
    )
    await store.dequeue_rollout()
    clock.advance(1)
    await store.check_timeouts()
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    await store.dequeue_rollout()
    clock.advance(1)
    await store.check_timeouts()
    attempt = await store.get_latest_attempt(r.rollout_id)
    assert attempt.status == "unresponsive" and not is_harness_ended(attempt)
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"
