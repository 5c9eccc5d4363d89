"""Behaviour of SqliteStore's API: the agent-lightning LightningStore semantics,
deadlines on a controlled clock, run state, read-only access, views, and
concurrency (asyncio tasks and a second process on the same file)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from store_helpers import PYTHON, REPO, WORKER, FakeClock, check_invariants

from agl.store import ReadOnlyStoreError, SqliteStore, StoreDamaged
from agl.types import UNSET, AttemptStatus, RolloutConfig, RolloutStatus, Span

asyncio_test = pytest.mark.asyncio


def llm_span(attempted, n: int = 200, **kw) -> Span:
    return Span(
        rollout_id=attempted.rollout_id,
        attempt_id=attempted.attempt.attempt_id,
        name="llm.chat",
        prompt_token_ids=list(range(n)),
        response_token_ids=list(range(n, 2 * n)),
        response_logprobs=[-0.5] * n,
        attributes={"policy_version": 3, "finish_reason": "stop"},
        **kw,
    )


def reward_span(attempted, reward: float) -> Span:
    return Span(
        rollout_id=attempted.rollout_id,
        attempt_id=attempted.attempt.attempt_id,
        name="reward",
        attributes={"reward": reward},
    )


# -- queue ----------------------------------------------------------------------


@asyncio_test
async def test_enqueue_dequeue_fifo(store: SqliteStore, clock: FakeClock):
    rollouts = [await store.enqueue_rollout({"i": i}, mode="train") for i in range(5)]
    assert all(r.status == "queuing" and r.start_time == clock.now for r in rollouts)
    got = [await store.dequeue_rollout(worker_id="w") for _ in range(5)]
    assert [g.rollout_id for g in got] == [r.rollout_id for r in rollouts]
    assert [g.input for g in got] == [{"i": i} for i in range(5)]
    for g in got:
        assert g.status == "preparing" and g.attempt.status == "preparing"
        assert g.attempt.sequence_id == 1 and g.attempt.worker_id == "w"
        assert g.attempt.session_id == store.session_id
    assert await store.dequeue_rollout() is None
    stored = await store.get_rollout_by_id(rollouts[0].rollout_id)
    assert stored.status == RolloutStatus.PREPARING


@asyncio_test
async def test_start_rollout_bypasses_queue(store: SqliteStore):
    queued = await store.enqueue_rollout("q")
    started = await store.start_rollout("s", mode="val", metadata={"step": 1})
    assert started.status == "preparing" and started.attempt.status == "preparing"
    assert started.attempt.sequence_id == 1
    assert (await store.dequeue_rollout()).rollout_id == queued.rollout_id
    assert await store.dequeue_rollout() is None


@asyncio_test
async def test_start_attempt_creates_next_attempt(store: SqliteStore):
    r = await store.enqueue_rollout("x")
    a1 = await store.dequeue_rollout()
    await store.update_attempt(r.rollout_id, "latest", status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"
    a2 = await store.start_attempt(r.rollout_id)  # explicit retry revives it (R2)
    assert a2.attempt.sequence_id == 2 and a2.status == "preparing"
    assert (await store.get_rollout_by_id(r.rollout_id)).end_time is None
    attempts = await store.query_attempts(r.rollout_id)
    assert [a.attempt_id for a in attempts] == [a1.attempt.attempt_id, a2.attempt.attempt_id]
    assert (await store.get_latest_attempt(r.rollout_id)).attempt_id == a2.attempt.attempt_id


@asyncio_test
async def test_requeued_rollout_goes_to_back_and_gets_attempt_n_plus_1(store: SqliteStore):
    cfg = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    first = await store.enqueue_rollout("first", config=cfg)
    second = await store.enqueue_rollout("second")
    a = await store.dequeue_rollout()
    assert a.rollout_id == first.rollout_id
    await store.update_attempt(first.rollout_id, a.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(first.rollout_id)).status == "requeuing"
    assert (await store.dequeue_rollout()).rollout_id == second.rollout_id
    again = await store.dequeue_rollout()
    assert again.rollout_id == first.rollout_id and again.attempt.sequence_id == 2
    await store.update_attempt(first.rollout_id, "latest", status="failed")
    final = await store.get_rollout_by_id(first.rollout_id)
    assert final.status == "failed" and final.end_time is not None  # max_attempts reached


@asyncio_test
async def test_retry_condition_is_respected(store: SqliteStore):
    cfg = RolloutConfig(max_attempts=5, retry_condition=["timeout"])
    r = await store.enqueue_rollout("x", config=cfg)
    await store.dequeue_rollout()
    await store.update_attempt(r.rollout_id, "latest", status="failed")  # failed is not retried
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"


@asyncio_test
async def test_query_rollouts_filters(store: SqliteStore):
    rs = [await store.enqueue_rollout(i, metadata={"step": i % 3}) for i in range(9)]
    await store.dequeue_rollout()
    assert len(await store.query_rollouts()) == 9
    assert [r.rollout_id for r in await store.query_rollouts(status="preparing")] == [rs[0].rollout_id]
    assert len(await store.query_rollouts(status=["queuing", "preparing"])) == 9
    by_step = await store.query_rollouts(step=1)
    assert [r.rollout_id for r in by_step] == [rs[1].rollout_id, rs[4].rollout_id, rs[7].rollout_id]
    assert by_step[0].step == 1
    some = await store.query_rollouts(rollout_ids=[rs[2].rollout_id, "ro-unknown"], status="queuing")
    assert [r.rollout_id for r in some] == [rs[2].rollout_id]
    with pytest.raises(ValueError):
        await store.query_rollouts(status="bogus")


@asyncio_test
async def test_enqueue_rollouts_is_one_ordered_batch(store: SqliteStore):
    rs = await store.enqueue_rollouts(["a", "b", "c"], metadata=[{"step": 0, "k": i} for i in range(3)])
    assert [r.input for r in rs] == ["a", "b", "c"]
    assert [(await store.dequeue_rollout()).input for _ in range(3)] == ["a", "b", "c"]
    with pytest.raises(ValueError):  # invalid mode: nothing of the batch is stored
        await store.enqueue_rollouts(["d", "e"], mode="bogus")
    assert len(await store.query_rollouts()) == 3


# -- updates, UNSET and unknown ids ----------------------------------------------


@asyncio_test
async def test_update_rollout_unset_vs_none(store: SqliteStore):
    res = await store.add_resources({"llm": {"endpoint": "http://x"}})
    r = await store.enqueue_rollout({"q": 1}, mode="train", metadata={"step": 2})
    assert r.resources_id == res.resources_id
    same = await store.update_rollout(r.rollout_id)
    assert same.model_dump() == r.model_dump()
    cleared = await store.update_rollout(r.rollout_id, mode=None, resources_id=None, metadata=None)
    assert cleared.mode is None and cleared.resources_id is None and cleared.metadata is None
    assert cleared.input == {"q": 1} and cleared.status == "queuing"
    changed = await store.update_rollout(r.rollout_id, input={"q": 2}, metadata={"step": 5}, mode=UNSET)
    assert changed.input == {"q": 2} and changed.step == 5
    assert [x.rollout_id for x in await store.query_rollouts(step=5)] == [r.rollout_id]


@asyncio_test
async def test_update_rollout_status_explicit(store: SqliteStore, clock: FakeClock):
    a = await store.enqueue_rollout("a")
    b = await store.enqueue_rollout("b")
    cancelled = await store.update_rollout(a.rollout_id, status="cancelled")
    assert cancelled.status == "cancelled" and cancelled.end_time == clock.now
    assert (await store.dequeue_rollout()).rollout_id == b.rollout_id  # cancelled left the queue
    assert await store.dequeue_rollout() is None
    back = await store.update_rollout(a.rollout_id, status="queuing")
    assert back.end_time is None
    assert (await store.dequeue_rollout()).rollout_id == a.rollout_id


@asyncio_test
async def test_update_attempt_fields(store: SqliteStore):
    r = await store.enqueue_rollout("x")
    a = await store.dequeue_rollout()
    updated = await store.update_attempt(
        r.rollout_id, a.attempt.attempt_id, worker_id="w2", last_heartbeat_time=123.0, metadata={"k": 1}
    )
    assert (updated.worker_id, updated.last_heartbeat_time, updated.metadata) == ("w2", 123.0, {"k": 1})
    assert updated.status == "preparing"
    cleared = await store.update_attempt(r.rollout_id, "latest", worker_id=None, metadata=None)
    assert cleared.worker_id is None and cleared.metadata is None and cleared.last_heartbeat_time == 123.0
    done = await store.update_attempt(r.rollout_id, "latest", status=AttemptStatus.SUCCEEDED)
    assert done.status == "succeeded" and done.end_time is not None


@asyncio_test
async def test_unknown_ids_raise_value_error(store: SqliteStore):
    r = await store.enqueue_rollout("x")
    span = Span(rollout_id="ro-nope", attempt_id="at-nope", name="n")
    calls = [
        store.start_attempt("ro-nope"),
        store.update_rollout("ro-nope", status="cancelled"),
        store.update_attempt("ro-nope", "latest", status="failed"),
        store.update_attempt(r.rollout_id, "latest", status="failed"),  # no attempts yet
        store.update_attempt(r.rollout_id, "at-nope", status="failed"),
        store.query_attempts("ro-nope"),
        store.get_latest_attempt("ro-nope"),
        store.query_spans("ro-nope"),
        store.query_spans(r.rollout_id, "at-nope"),
        store.add_span(span),
        store.add_span(span.model_copy(update={"rollout_id": r.rollout_id})),
        store.get_next_span_sequence_id("ro-nope", "at-nope"),
        store.wait_for_rollouts(["ro-nope"], timeout=0),
        store.update_resources("rs-nope", {}),
        store.enqueue_rollout("y", resources_id="rs-nope"),
    ]
    for call in calls:
        with pytest.raises(ValueError):
            await call
    assert await store.get_rollout_by_id("ro-nope") is None
    assert await store.get_resources_by_id("rs-nope") is None
    assert await store.get_latest_attempt(r.rollout_id) is None
    assert await store.query_spans(r.rollout_id, "latest") == []


# -- spans ----------------------------------------------------------------------


@asyncio_test
async def test_span_roundtrip_and_blob_encoding(store: SqliteStore, path: Path):
    await store.enqueue_rollout("x")
    a = await store.dequeue_rollout()
    span = llm_span(a, n=200, trace_id="t" * 32, parent_id="p1", start_time=1.0, end_time=2.5)
    stored = await store.add_span(span)
    assert stored.sequence_id == 1
    [back] = await store.query_spans(a.rollout_id)
    assert back == stored
    assert back.response_logprobs == [-0.5] * 200
    conn = sqlite3.connect(path)
    blob, lp = conn.execute("SELECT prompt_token_ids, response_logprobs FROM spans").fetchone()
    conn.close()
    assert len(blob) == 800 and blob[:8] == (0).to_bytes(4, "little") + (1).to_bytes(4, "little")
    assert len(lp) == 800
    with pytest.raises(ValueError):  # ids must fit in int32
        await store.add_span(
            Span(rollout_id=a.rollout_id, attempt_id=a.attempt.attempt_id, name="x", prompt_token_ids=[2**40])
        )


@asyncio_test
async def test_span_accepts_numpy_arrays(store: SqliteStore):
    np = pytest.importorskip("numpy")
    await store.enqueue_rollout("x")
    a = await store.dequeue_rollout()
    span = Span(
        rollout_id=a.rollout_id,
        attempt_id=a.attempt.attempt_id,
        name="llm.completion",
        prompt_token_ids=np.arange(5, dtype=np.int64),
        response_logprobs=np.full(3, -1.25, dtype=np.float32),
    )
    await store.add_span(span)
    [back] = await store.query_spans(a.rollout_id)
    assert back.prompt_token_ids == [0, 1, 2, 3, 4] and back.response_logprobs == [-1.25] * 3


@asyncio_test
async def test_span_sequence_ids(store: SqliteStore):
    await store.enqueue_rollout("x")
    a = await store.dequeue_rollout()
    rid, aid = a.rollout_id, a.attempt.attempt_id
    assert await store.get_next_span_sequence_id(rid, aid) == 1
    assert (await store.add_span(Span(rollout_id=rid, attempt_id=aid, name="n"))).sequence_id == 2
    assert (await store.add_span(Span(rollout_id=rid, attempt_id=aid, name="n", sequence_id=10))).sequence_id == 10
    assert await store.get_next_span_sequence_id(rid, aid) == 11
    assert (await store.add_span(Span(rollout_id=rid, attempt_id=aid, name="n"))).sequence_id == 12
    assert [s.sequence_id for s in await store.query_spans(rid)] == [2, 10, 12]


@asyncio_test
async def test_span_is_heartbeat_and_moves_to_running(store: SqliteStore, clock: FakeClock):
    r = await store.enqueue_rollout("x")
    a = await store.dequeue_rollout()
    clock.advance(2)
    await store.add_span(llm_span(a))
    attempt = await store.get_latest_attempt(r.rollout_id)
    assert attempt.status == "running" and attempt.last_heartbeat_time == clock.now
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "running"
    await store.add_span(reward_span(a, 1.0))
    await store.update_attempt(r.rollout_id, "latest", status="succeeded")
    await store.add_span(reward_span(a, 0.5))  # a late span changes no status
    assert (await store.get_latest_attempt(r.rollout_id)).status == "succeeded"
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "succeeded"


@asyncio_test
async def test_span_on_old_attempt_does_not_propagate(store: SqliteStore):
    cfg = RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])
    r = await store.enqueue_rollout("x", config=cfg)
    a1 = await store.dequeue_rollout()
    await store.update_attempt(r.rollout_id, a1.attempt.attempt_id, status="unresponsive")
    a2 = await store.dequeue_rollout()
    await store.add_span(llm_span(a1))  # the old worker comes back
    attempts = await store.query_attempts(r.rollout_id)
    assert [a.status for a in attempts] == ["unresponsive", "preparing"]
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "preparing"
    await store.add_span(llm_span(a2))
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "running"
    assert [s.attempt_id for s in await store.query_spans(r.rollout_id, "latest")] == [a2.attempt.attempt_id]
    assert len(await store.query_spans(r.rollout_id, a1.attempt.attempt_id)) == 1
    assert len(await store.query_spans(r.rollout_id)) == 2


@asyncio_test
async def test_span_revives_unresponsive_latest_attempt_from_queue(store: SqliteStore):
    cfg = RolloutConfig(max_attempts=2, retry_condition=["unresponsive"])
    r = await store.enqueue_rollout("x", config=cfg)
    a = await store.dequeue_rollout()
    await store.update_attempt(r.rollout_id, "latest", status="unresponsive")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    await store.add_span(llm_span(a))
    assert (await store.get_latest_attempt(r.rollout_id)).status == "running"
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "running"
    assert await store.dequeue_rollout() is None  # it left the queue


@asyncio_test
async def test_terminal_rollout_is_final(store: SqliteStore):
    r = await store.enqueue_rollout("x")
    a = await store.dequeue_rollout()
    await store.update_rollout(r.rollout_id, status="cancelled")
    await store.add_span(llm_span(a))
    await store.update_attempt(r.rollout_id, "latest", status="succeeded")
    assert (await store.get_latest_attempt(r.rollout_id)).status == "succeeded"  # recorded on the attempt
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "cancelled"  # but not propagated


@asyncio_test
async def test_non_finite_floats_do_not_break_json(store: SqliteStore, path: Path):
    await store.enqueue_rollout("x")
    a = await store.dequeue_rollout()
    await store.add_span(reward_span(a, float("nan")))
    [span] = await store.query_spans(a.rollout_id)
    assert span.attributes == {"reward": None}
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT reward FROM rollout_rewards").fetchall() == [(None,)]
    conn.close()


@asyncio_test
async def test_waiter_on_closed_store_gets_clear_error(path: Path):
    store = SqliteStore(path, watchdog_interval=None)
    r = await store.enqueue_rollout("x")
    waiter = asyncio.create_task(store.wait_for_rollouts([r.rollout_id]))
    await asyncio.sleep(0.05)
    await store.close()
    with pytest.raises(RuntimeError, match="closed"):
        await waiter


# -- resources --------------------------------------------------------------------


@asyncio_test
async def test_resources_versions(store: SqliteStore):
    assert await store.get_latest_resources() is None
    r0 = await store.enqueue_rollout("x")
    assert r0.resources_id is None
    v1 = await store.add_resources({"llm": {"model": "a"}, "policy_version": 1})
    v2 = await store.add_resources({"llm": {"model": "b"}, "policy_version": 2}, resources_id="policy-2")
    assert v2.resources_id == "policy-2"
    assert (await store.get_latest_resources()).resources_id == "policy-2"
    r1 = await store.enqueue_rollout("y")
    assert r1.resources_id == "policy-2"
    r2 = await store.enqueue_rollout("z", resources_id=v1.resources_id)
    assert r2.resources_id == v1.resources_id
    upd = await store.update_resources(v1.resources_id, {"policy_version": 11})
    assert upd.resources == {"policy_version": 11}
    assert (await store.get_latest_resources()).resources_id == v1.resources_id
    assert (await store.get_resources_by_id("policy-2")).resources["policy_version"] == 2
    with pytest.raises(ValueError):
        await store.add_resources({}, resources_id="policy-2")


# -- waiting ----------------------------------------------------------------------


@asyncio_test
async def test_wait_for_rollouts_wakes_on_finish(store: SqliteStore):
    rs = [await store.enqueue_rollout(i) for i in range(3)]
    ids = [r.rollout_id for r in rs]
    assert await store.wait_for_rollouts(ids, timeout=0) == []
    waiter = asyncio.create_task(store.wait_for_rollouts(ids, timeout=30))
    for _ in range(3):
        a = await store.dequeue_rollout()
        await store.update_attempt(a.rollout_id, "latest", status="succeeded")
    t0 = time.monotonic()
    done = await waiter
    assert time.monotonic() - t0 < 1.0
    assert [r.rollout_id for r in done] == ids and all(r.status == "succeeded" for r in done)


@asyncio_test
async def test_wait_for_rollouts_timeout_returns_partial(store: SqliteStore):
    a, b = await store.enqueue_rollout("a"), await store.enqueue_rollout("b")
    await store.update_rollout(a.rollout_id, status="cancelled")
    t0 = time.monotonic()
    done = await store.wait_for_rollouts([b.rollout_id, a.rollout_id], timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 2
    assert [r.rollout_id for r in done] == [a.rollout_id]


@asyncio_test
async def test_wait_sees_other_connections_commits(store: SqliteStore, path: Path):
    r = await store.enqueue_rollout("x")
    other = SqliteStore(path, watchdog_interval=None)
    try:
        waiter = asyncio.create_task(store.wait_for_rollouts([r.rollout_id], timeout=10))
        await asyncio.sleep(0.05)
        await other.update_rollout(r.rollout_id, status="failed")  # no event reaches `store`
        t0 = time.monotonic()
        [done] = await waiter
        assert done.status == "failed" and time.monotonic() - t0 < 1.5
    finally:
        await other.close()


# -- deadlines ----------------------------------------------------------------------


@asyncio_test
async def test_timeout_from_attempt_start(store: SqliteStore, clock: FakeClock):
    cfg = RolloutConfig(timeout_seconds=10, max_attempts=2, retry_condition=["timeout"])
    r = await store.enqueue_rollout("x", config=cfg)
    a = await store.dequeue_rollout()
    clock.advance(5)
    await store.add_span(llm_span(a))  # heartbeats do not extend the timeout
    clock.advance(4.9)
    assert await store.check_timeouts() == []
    clock.advance(0.1)
    [changed] = await store.check_timeouts()
    assert changed.status == "timeout" and changed.end_time == clock.now
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    a2 = await store.dequeue_rollout()
    assert a2.attempt.sequence_id == 2
    clock.advance(10)
    await store.check_timeouts()
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"  # max_attempts reached


@asyncio_test
async def test_unresponsive_from_last_heartbeat(store: SqliteStore, clock: FakeClock):
    cfg = RolloutConfig(unresponsive_seconds=3)
    r = await store.enqueue_rollout("x", config=cfg)
    a = await store.dequeue_rollout()
    clock.advance(2.9)
    assert await store.check_timeouts() == []
    await store.add_span(llm_span(a))  # heartbeat at t+2.9
    clock.advance(2.9)
    assert await store.check_timeouts() == []
    clock.advance(0.2)
    [changed] = await store.check_timeouts()
    assert changed.status == "unresponsive"
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"  # not in retry_condition


@asyncio_test
async def test_unresponsive_without_heartbeat_counts_from_start(store: SqliteStore, clock: FakeClock):
    r = await store.start_rollout(
        "x", config={"unresponsive_seconds": 1, "max_attempts": 2, "retry_condition": ["unresponsive"]}
    )
    clock.advance(1)
    await store.check_timeouts()
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"


@asyncio_test
async def test_dequeue_and_wait_apply_deadlines(store: SqliteStore, clock: FakeClock):
    cfg = RolloutConfig(timeout_seconds=1, max_attempts=2, retry_condition=["timeout"])
    r = await store.enqueue_rollout("x", config=cfg)
    await store.dequeue_rollout()
    clock.advance(1)
    again = await store.dequeue_rollout()  # the dequeue itself expired attempt 1 and requeued
    assert again.rollout_id == r.rollout_id and again.attempt.sequence_id == 2
    clock.advance(1)
    [done] = await store.wait_for_rollouts([r.rollout_id], timeout=5)
    assert done.status == "failed"


@asyncio_test
async def test_config_update_moves_deadlines(store: SqliteStore, clock: FakeClock):
    r = await store.enqueue_rollout("x")
    await store.dequeue_rollout()
    clock.advance(100)
    assert await store.check_timeouts() == []
    await store.update_rollout(r.rollout_id, config=RolloutConfig(timeout_seconds=50))
    [changed] = await store.check_timeouts()
    assert changed.status == "timeout"


@asyncio_test
async def test_background_watchdog(path: Path, clock: FakeClock):
    async with SqliteStore(path, clock=clock, watchdog_interval=0.02) as store:
        r = await store.enqueue_rollout("x", config={"timeout_seconds": 5})
        await store.dequeue_rollout()
        clock.advance(6)
        [done] = await store.wait_for_rollouts([r.rollout_id], timeout=5)
        assert done.status == "failed"
        assert (await store.get_latest_attempt(r.rollout_id)).status == "timeout"


# -- sessions -------------------------------------------------------------------------


@asyncio_test
async def test_close_orphans_own_attempts(path: Path, clock: FakeClock):
    store = SqliteStore(path, clock=clock, watchdog_interval=None)
    retry = await store.enqueue_rollout("r", config={"max_attempts": 2, "retry_condition": ["unresponsive"]})
    plain = await store.enqueue_rollout("p")
    await store.dequeue_rollout()
    await store.dequeue_rollout()
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(RuntimeError):
        await store.enqueue_rollout("late")
    reopened = SqliteStore(path, clock=clock, watchdog_interval=None)
    try:
        # R7: closing is not the agent's failure, so neither rollout used up a try,
        # not even the one with max_attempts=1 (tests/test_store_sessions.py has more).
        assert (await reopened.get_rollout_by_id(retry.rollout_id)).status == "requeuing"
        assert (await reopened.get_rollout_by_id(plain.rollout_id)).status == "requeuing"
        attempt = await reopened.get_latest_attempt(plain.rollout_id)
        assert attempt.status == "unresponsive" and attempt.metadata["harness_ended"] == "closed"
        assert [(await reopened.dequeue_rollout()).rollout_id for _ in range(2)] == [retry.rollout_id, plain.rollout_id]
    finally:
        await reopened.close()
    assert check_invariants(path) == []


@asyncio_test
async def test_dead_session_is_reaped_on_open(path: Path):
    store = SqliteStore(path, watchdog_interval=None)
    r = await store.enqueue_rollout("x", config={"max_attempts": 2, "retry_condition": ["unresponsive"]})
    await store.dequeue_rollout()
    # Pretend the owning process died: point the session at a pid that does not exist.
    conn = sqlite3.connect(path)
    conn.execute("UPDATE sessions SET pid = 999999999 WHERE session_id = ?", (store.session_id,))
    conn.commit()
    conn.close()
    other = SqliteStore(path, watchdog_interval=None)
    try:
        assert (await other.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    finally:
        await other.close()
        await store.close()


# -- read-only ------------------------------------------------------------------------


@asyncio_test
async def test_async_open_and_bad_files(path: Path, tmp_path: Path):
    store = await SqliteStore.open(path, watchdog_interval=None)
    await store.enqueue_rollout("x")
    await store.close()
    reader = await SqliteStore.open(path, readonly=True)
    assert len(await reader.query_rollouts()) == 1
    await reader.close()
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreDamaged, match=f"^{junk} is damaged \\(not an SQLite database"):  # one line, never reused
        await SqliteStore.open(junk)
    with pytest.raises(StoreDamaged):
        SqliteStore(junk)
    assert junk.read_bytes() == b"not a database" * 100


@asyncio_test
async def test_readonly_next_to_writer(store: SqliteStore, path: Path):
    r = await store.enqueue_rollout("x", metadata={"step": 0})
    reader = SqliteStore.open_readonly(path)
    try:
        assert reader.session_id is None
        assert [x.rollout_id for x in await reader.query_rollouts(step=0)] == [r.rollout_id]
        await store.enqueue_rollout("y")  # the writer is not blocked by the reader
        assert len(await reader.query_rollouts()) == 2
        for call in (
            reader.enqueue_rollout("z"),
            reader.dequeue_rollout(),
            reader.check_timeouts(),
            reader.set_run_info("k", 1),
        ):
            with pytest.raises(ReadOnlyStoreError):
                await call
        waiter = asyncio.create_task(reader.wait_for_rollouts([r.rollout_id], timeout=10))
        await asyncio.sleep(0.05)
        await store.update_rollout(r.rollout_id, status="succeeded")
        assert [x.status for x in await waiter] == ["succeeded"]
    finally:
        await reader.close()
    with pytest.raises(FileNotFoundError):
        SqliteStore.open_readonly(path.parent / "missing.sqlite")


# -- run state ------------------------------------------------------------------------


@asyncio_test
async def test_checkpoints_roundtrip_and_pruning(path: Path):
    store = SqliteStore(path, watchdog_interval=None, keep_checkpoints=2)
    try:
        assert await store.load_checkpoint() is None
        for step in range(1, 5):
            await store.save_checkpoint(
                step,
                policy_version=step * 10,
                state={"cursor": step, "rng": [1, 2, step]},
                blobs={"adapter": bytes([step]) * 1000, "optimizer": b"o" * step},
                metrics={"loss": 1 / step},
            )
        latest = await store.load_checkpoint()
        assert (latest.step, latest.policy_version, latest.state) == (4, 40, {"cursor": 4, "rng": [1, 2, 4]})
        assert latest.blobs == {"adapter": bytes([4]) * 1000, "optimizer": b"oooo"}
        assert latest.metrics == {"loss": 0.25} and not latest.blobs_pruned
        assert (await store.load_checkpoint(3)).blobs["optimizer"] == b"ooo"
        old = await store.load_checkpoint(1)
        assert old.blobs_pruned and old.blobs == {} and old.state["cursor"] == 1
        assert [c.step for c in await store.list_checkpoints()] == [1, 2, 3, 4]
        # Re-saving a step replaces it.
        await store.save_checkpoint(4, 41, {"cursor": 99}, {"adapter": b"new"})
        again = await store.load_checkpoint()
        assert again.policy_version == 41 and again.blobs == {"adapter": b"new"}
        assert await store.load_checkpoint(17) is None
    finally:
        await store.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(DISTINCT step) FROM checkpoint_blobs").fetchone()[0] == 2
    conn.close()


@asyncio_test
async def test_run_info_and_metrics(store: SqliteStore):
    assert await store.get_run_info("config") is None
    assert await store.get_run_info("config", default={}) == {}
    await store.set_run_info("config", {"lr": 1e-4, "model": "smol"})
    await store.set_run_info("config", {"lr": 2e-4})
    assert await store.get_run_info("config") == {"lr": 2e-4}
    assert await store.get_all_run_info() == {"config": {"lr": 2e-4}}
    await store.log_metrics(0, {"reward": {"mean": 0.5, "max": 1}, "ok": True, "note": "x"})
    await store.log_metrics(1, {"reward": {"mean": 0.75}})
    await store.log_metrics(1, {"reward": {"mean": 0.8}})
    assert await store.query_metrics() == {
        0: {"note": "x", "ok": 1, "reward/max": 1, "reward/mean": 0.5},
        1: {"reward/mean": 0.8},
    }
    assert await store.query_metrics(names=["reward/mean"]) == {0: {"reward/mean": 0.5}, 1: {"reward/mean": 0.8}}
    assert await store.query_metrics(step=1) == {1: {"reward/mean": 0.8}}
    with pytest.raises(TypeError):
        await store.log_metrics(2, {"bad": [1, 2]})


# -- SQL views (plain sqlite3) ------------------------------------------------------------


@asyncio_test
async def test_views_answer_questions_in_plain_sql(store: SqliteStore, path: Path, clock: FakeClock):
    rewards = {0: [1.0, 0.0, None], 1: [0.5, 0.5, 1.0]}
    for step, rs in rewards.items():
        batch = await store.enqueue_rollouts(list(range(len(rs))), metadata={"step": step})
        for rollout, reward in zip(batch, rs):
            a = await store.dequeue_rollout()
            assert a.rollout_id == rollout.rollout_id
            clock.advance(1)
            await store.add_span(llm_span(a, n=10))
            if reward is None:
                await store.update_attempt(a.rollout_id, "latest", status="failed")
            else:
                await store.add_span(reward_span(a, reward - 1))  # superseded by the last one
                await store.add_span(reward_span(a, reward))
                clock.advance(1)
                await store.update_attempt(a.rollout_id, "latest", status="succeeded")
    await store.save_checkpoint(0, 1, {}, {"adapter": b"x" * 100})
    conn = sqlite3.connect(path)
    summary = conn.execute(
        "SELECT step, rollouts, succeeded, failed, rewarded, mean_reward FROM step_summary ORDER BY step"
    ).fetchall()
    assert summary == [(0, 3, 2, 1, 2, 0.5), (1, 3, 3, 0, 3, pytest.approx(2 / 3))]
    assert conn.execute("SELECT reward FROM rollout_rewards WHERE step = 1 ORDER BY rowid").fetchall() == [
        (0.5,),
        (0.5,),
        (1.0,),
    ]
    durations = conn.execute("SELECT duration, spans FROM attempt_durations WHERE status = 'succeeded'").fetchall()
    assert durations[0] == (2.0, 3)
    calls = conn.execute("SELECT prompt_tokens, response_tokens, policy_version FROM llm_calls").fetchall()
    assert len(calls) == 6 and calls[0] == (10, 10, 3)
    assert conn.execute("SELECT step, blob_bytes FROM checkpoint_sizes").fetchall() == [(0, 100)]
    assert conn.execute("SELECT count(*) FROM latest_attempts WHERE attempt_status = 'failed'").fetchone() == (1,)
    conn.close()


@asyncio_test
async def test_docs_queries_run(store: SqliteStore, path: Path):
    """Every SQL example in docs/store.md runs on a real store and answers something."""
    retry = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    for step in range(2):
        await store.enqueue_rollouts(list(range(3)), config=retry, metadata={"step": step})
        while (a := await store.dequeue_rollout(worker_id="w")) is not None:
            await store.add_span(llm_span(a, n=8))
            failed = a.attempt.sequence_id == 1 and a.input == 0
            if not failed:
                await store.add_span(reward_span(a, float(a.input)))
            await store.update_attempt(a.rollout_id, "latest", status="failed" if failed else "succeeded")
        await store.log_metrics(step, {"reward": {"mean": 0.5 + step}})
        await store.save_checkpoint(step, step, {"cursor": step}, {"adapter": b"x"})
    await store.enqueue_rollout("pending")
    await store.start_rollout("in flight")
    runner = SqliteStore(path, watchdog_interval=None)
    await runner.start_rollout("cut short")
    await runner.close()  # R7: its attempt ends with the harness-ended note
    docs = (REPO / "docs" / "store.md").read_text()
    blocks = [b.split("```", 1)[0] for b in docs.split("```sql\n")[1:]]
    assert len(blocks) >= 8
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        for sql in blocks:
            assert conn.execute(sql).fetchall(), sql
    finally:
        conn.close()


# -- concurrency ---------------------------------------------------------------------------


@asyncio_test
async def test_concurrent_dequeues_tasks_and_second_process(path: Path):
    store = SqliteStore(path, watchdog_interval=None)
    try:
        n = 1500
        rollouts = await store.enqueue_rollouts(list(range(n)))
        proc = subprocess.Popen(
            [PYTHON, str(WORKER), "dequeue", str(path)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready"

        async def drain(name: str) -> list[str]:
            got = []
            while (a := await store.dequeue_rollout(worker_id=name)) is not None:
                got.append(a.rollout_id)
                await asyncio.sleep(0)
            return got

        proc.stdin.write("go\n")
        proc.stdin.flush()
        ours = await asyncio.gather(*(drain(f"task-{i}") for i in range(16)))
        theirs = json.loads(await asyncio.to_thread(proc.stdout.readline))
        proc.communicate(timeout=60)  # EOF: it closes, requeuing what it holds (R7), after our drain
        mine = [rid for got in ours for rid in got]
        assert len(mine) + len(theirs) == n, (len(mine), len(theirs))
        assert sorted(mine + theirs) == sorted(r.rollout_id for r in rollouts)  # each exactly once
        assert theirs, "the second process should have won some dequeues"
    finally:
        await store.close()
    assert check_invariants(path) == []


@asyncio_test
async def test_concurrent_mixed_operations_keep_invariants(store: SqliteStore, path: Path):
    cfg = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    await store.enqueue_rollouts(list(range(200)), config=cfg)

    async def runner(i: int) -> int:
        finished = 0
        while (a := await store.dequeue_rollout(worker_id=f"r{i}")) is not None:
            await store.add_span(llm_span(a, n=20))
            status = "failed" if (hash(a.attempt.attempt_id) % 3 == 0) else "succeeded"
            await store.update_attempt(a.rollout_id, a.attempt.attempt_id, status=status)
            finished += 1
        return finished

    total = sum(await asyncio.gather(*(runner(i) for i in range(8))))
    assert total >= 200
    assert check_invariants(path) == []
    statuses = {r.status for r in await store.query_rollouts()}
    assert statuses <= {"succeeded", "failed"}
