"""Jobs whose rollouts fail say so: all failed -> the job fails with the most common error in
full (status.json `failed`, non-zero exit); some failed -> the eval table says how many and why."""

import json

import pytest
from failing_agents import ERROR
from helpers import compose_cfg, typed_cfg

import agl
from agl.config import to_typed
from agl.eval.failures import Failures, RolloutsFailed, most_common
from agl.jobs.eval import run_eval
from agl.jobs.grpo import train

TINY = [
    "model=tiny",
    "progress=false",
    "task=custom",
    "task.data=failing_agents:load",
    "task.eval_size=4",
    "task.max_tokens=4",
]


def test_most_common_error_and_its_description():
    assert most_common(["b", "a", "a", "b", "c"]) == ("b", 2)
    assert (
        Failures(4, 4, "E: x", 4).describe("eval test")
        == "4 of 4 rollouts of eval test failed; the most common error (4 of 4): E: x"
    )


def test_an_eval_whose_every_rollout_fails_fails_with_the_error_in_full(tmp_path):
    """The job harness.py runs (here in this process, agl.run): it raises, so the command exits non-zero with the
    error on stderr."""
    run_dir = tmp_path / "run"
    with pytest.raises(RolloutsFailed) as failed:
        agl.run(*TINY, "task.agent=failing_agents:always_fails", "algo=eval", run_dir=run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed"
    assert status["error"] == (
        f"RolloutsFailed: 4 of 4 rollouts of eval test failed; the most common error (4 of 4): ConnectionError: {ERROR}"
    )
    assert ERROR in str(failed.value)
    assert not (run_dir / "eval.md").exists()  # no table of zeros that looks like a score


async def test_an_eval_where_some_rollouts_fail_says_how_many_and_why(tmp_path, capsys):
    result = await run_eval(typed_cfg(TINY + ["task.agent=failing_agents:fails_on_odd_tasks", "algo=eval"]), tmp_path)
    assert result["summary"]["failed"] == 0.5
    note = "2 of 4 rollouts of eval test failed; the most common error (1 of 2): ValueError: task 1 is odd"
    assert note in (tmp_path / "eval.md").read_text() and note in capsys.readouterr().out


async def test_a_training_step_whose_every_rollout_fails_fails_the_job(tmp_path):
    cfg = compose_cfg(
        TINY
        + [
            "task.agent=failing_agents:fails_in_training",
            "task.eval_size=2",
            "algo=grpo",
            "algo.steps=2",
            "algo.batch_size=2",
            "algo.group_size=2",
            "algo.micro_batch_size=2",
            "runner.max_attempts=1",
        ]
    )
    with pytest.raises(
        RolloutsFailed,
        match=(
            "4 of 4 rollouts of training step 0 failed; "
            "the most common error \\(4 of 4\\): RuntimeError: training rollouts always fail"
        ),
    ):
        await train(to_typed(cfg), tmp_path)
