"""Deterministic ids: rollouts, attempts, resources and sessions are numbered in the
store's own order, so two runs making the same calls get the same ids."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from store_helpers import FakeClock

from agl.store import SqliteStore
from agl.types import Span

asyncio_test = pytest.mark.asyncio


async def scripted_run(path: Path) -> list[str]:
    """A fixed sequence of calls; returns every id the store handed out."""
    store = SqliteStore(path, clock=FakeClock(), watchdog_interval=None)
    try:
        ids = [store.session_id]
        ids += [(await store.add_resources({"policy_version": v})).resources_id for v in range(2)]
        ids.append((await store.add_resources({"policy_version": 2}, resources_id="mine")).resources_id)
        ids += [
            r.rollout_id
            for r in await store.enqueue_rollouts(
                ["a", "b", "c"], config={"max_attempts": 2, "retry_condition": ["failed"]}
            )
        ]
        started = await store.start_rollout("d")
        ids += [started.rollout_id, started.attempt.attempt_id]
        while (got := await store.dequeue_rollout()) is not None:
            ids.append(got.attempt.attempt_id)
            await store.add_span(Span(rollout_id=got.rollout_id, attempt_id=got.attempt.attempt_id, name="x"))
            await store.update_attempt(got.rollout_id, "latest", status="failed" if got.input == "b" else "succeeded")
        ids.append((await store.start_attempt(started.rollout_id)).attempt.attempt_id)
        return ids
    finally:
        await store.close()


@asyncio_test
async def test_same_calls_give_same_ids(tmp_path: Path):
    first = await scripted_run(tmp_path / "one.sqlite")
    second = await scripted_run(tmp_path / "two.sqlite")
    assert first == second
    assert first == [
        "se-000001",
        "rs-000001",
        "rs-000002",
        "mine",
        "ro-000001",
        "ro-000002",
        "ro-000003",
        "ro-000004",
        "at-000004-1",
        "at-000001-1",
        "at-000002-1",
        "at-000003-1",
        "at-000002-2",  # b failed once and was retried
        "at-000004-2",
    ]
    assert len(set(first)) == len(first)


@asyncio_test
async def test_ids_are_unique_across_stores_sharing_the_file(tmp_path: Path):
    path = tmp_path / "store.sqlite"
    a = SqliteStore(path, watchdog_interval=None)
    b = SqliteStore(path, watchdog_interval=None)
    try:
        assert (a.session_id, b.session_id) == ("se-000001", "se-000002")
        made = await asyncio.gather(*(s.enqueue_rollout(i) for i in range(10) for s in (a, b)))
        assert sorted(r.rollout_id for r in made) == [f"ro-{n:06d}" for n in range(1, 21)]
        resources = await asyncio.gather(a.add_resources({}), b.add_resources({}))
        assert sorted(r.resources_id for r in resources) == ["rs-000001", "rs-000002"]
    finally:
        await a.close()
        await b.close()


@asyncio_test
async def test_generated_resources_id_steps_around_an_explicit_one(tmp_path: Path):
    store = SqliteStore(tmp_path / "store.sqlite", watchdog_interval=None)
    try:
        assert (await store.add_resources({}, resources_id="rs-000002")).resources_id == "rs-000002"
        assert (await store.add_resources({})).resources_id == "rs-000002-2"  # version 2's id was taken
        assert (await store.add_resources({})).resources_id == "rs-000003"
        await store.update_resources("rs-000002", {"v": 4})  # version 4 now, its id unchanged
        assert (await store.add_resources({})).resources_id == "rs-000005"
        assert (await store.get_latest_resources()).resources_id == "rs-000005"
    finally:
        await store.close()
