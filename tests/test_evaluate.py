"""Eval summaries and the trainer's resumable task cursor."""
import pytest

from agl.evaluate import summarize
from agl.checkpoint import TaskCursor


def test_summary_counts_failed_rollouts_as_zero_and_averages_metrics():
    rows = [
        {"rollout_id": "a", "status": "succeeded", "task_id": "t1", "reward": 1.0, "correct": 1.0, "completion_tokens": 10},
        {"rollout_id": "b", "status": "succeeded", "task_id": "t1", "reward": 0.1, "correct": 0.0, "completion_tokens": 30},
        {"rollout_id": "c", "status": "failed", "task_id": "t2"},
        {"rollout_id": "d", "status": "succeeded", "task_id": "t2", "reward": 0.0, "correct": 0.0, "completion_tokens": 20},
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
