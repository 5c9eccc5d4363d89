"""Eval summaries and the trainer's resumable task cursor."""

import pytest

from agl.eval.evaluate import summarize
from agl.train.resume import TaskCursor


def test_summary_counts_failed_rollouts_as_zero_and_averages_metrics():
    rows = [
        {
            "rollout_id": "a",
            "status": "succeeded",
            "task_id": "t1",
            "reward": 1.0,
            "correct": 1.0,
            "completion_tokens": 10,
        },
        {
            "rollout_id": "b",
            "status": "succeeded",
            "task_id": "t1",
            "reward": 0.1,
            "correct": 0.0,
            "completion_tokens": 30,
        },
        {"rollout_id": "c", "status": "failed", "task_id": "t2"},
        {
            "rollout_id": "d",
            "status": "succeeded",
            "task_id": "t2",
            "reward": 0.0,
            "correct": 0.0,
            "completion_tokens": 20,
        },
    ]
    summary = summarize(rows, k=2)
    assert summary["reward"] == pytest.approx(1.1 / 4)
    assert summary["correct"] == pytest.approx(0.25)
    assert summary["failed"] == pytest.approx(0.25)
    assert summary["completion_tokens"] == pytest.approx(20)
    assert summary["pass@2"] == pytest.approx(0.5)  # t1 passes, t2 does not
    assert summarize([]) == {"n": 0.0}


def test_task_cursor_is_a_seeded_permutation_per_epoch_and_resumes_exactly():
    cursor = TaskCursor(5, seed=3)
    first_epoch = cursor.take(5)
    assert sorted(first_epoch) == list(range(5))
    more = cursor.take(3)
    resumed = TaskCursor(5, seed=3, **TaskCursor(5, seed=3).state())
    assert resumed.take(5) == first_epoch
    saved = cursor.state()
    assert TaskCursor(5, seed=3, **saved).take(4) == cursor.take(4)
    assert saved["epoch"] == 1 and len(set(more)) == 3


class StoreOnlyRuntime:
    """What ``evaluate_rows`` uses of an ``agl.runtime.Runtime``: a store, resources, and
    ``run_rollouts``, here finishing each rollout at once with reward 1."""

    def __init__(self, store):
        self.store = store
        self.reused: list[list[str]] = []

    async def resources_id(self, resources: dict) -> str | None:
        return None

    async def run_rollouts(self, inputs, metadata, *, mode, resources_id, existing=(), desc="", on_finished=None):
        from agl.types import Span

        self.reused.append([r.rollout_id for r in existing])
        if existing:
            return list(existing)
        rollouts = await self.store.enqueue_rollouts(list(inputs), mode=mode, metadata=list(metadata))
        while (got := await self.store.dequeue_rollout()) is not None:
            await self.store.add_span(
                Span(
                    rollout_id=got.rollout_id,
                    attempt_id=got.attempt.attempt_id,
                    name="reward",
                    attributes={"reward": 1.0},
                )
            )
            await self.store.update_attempt(got.rollout_id, "latest", status="succeeded")
        return await self.store.query_rollouts(rollout_ids=[r.rollout_id for r in rollouts])


@pytest.mark.asyncio
async def test_evaluate_rows_reuses_the_rollouts_of_its_tag_found_by_a_metadata_query(store):
    from agl.eval.evaluate import evaluate_rows

    rt = StoreOnlyRuntime(store)
    rows = [{"id": "t1"}, {"id": "t2"}]
    run = lambda tag, k=1: evaluate_rows(rt, rows, resources={}, sampling={"temperature": 0.0}, k=k, tag=tag)  # noqa: E731
    first = await run({"eval_step": 0})
    assert [s["reward"] for s in first] == [1.0, 1.0] and rt.reused == [[]]
    assert await run({"eval_step": 0}) == first  # a resumed eval: the same rollouts, not new ones
    assert rt.reused[-1] == [s["rollout_id"] for s in first]
    other = await run({"candidate": "cot"}, k=2)  # another tag: its own rollouts
    assert rt.reused[-1] == [] and len(other) == 4
    assert {s["rollout_id"] for s in other}.isdisjoint(s["rollout_id"] for s in first)
    await run({"candidate": "cot"})  # the same tag with another count: enqueued afresh
    assert rt.reused[-1] == [] and len(await store.query_rollouts(metadata={"candidate": "cot"})) == 6


def test_tables_doctests():
    import doctest

    import agl.report.tables

    result = doctest.testmod(agl.report.tables)
    assert result.attempted > 0 and result.failed == 0
