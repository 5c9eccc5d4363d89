"""Two harnesses, one run: a run dir held by a live job is never trained by a second one.

Real ``harness.py`` processes (the process boundary and the kernel's lock are what is tested; the first is a
fresh interpreter, whose command line the refusal names, the others are forked: tests/prefork.py): a
``resume=`` started beside a live job is refused with one line naming the job's pid; once that job
is killed with ``kill -9`` its lock is gone with it, and the next ``resume=`` takes the run over
and finishes it, every step written once. A sweep whose job dir another process holds skips that
job with a clear line and trains the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import run_harness

from agl.jobs.run_lock import holding_run_dir

ROOT = Path(__file__).resolve().parents[1]
TINY_GRPO = [
    "model=tiny",
    "algo=grpo",
    "task=hello",
    "progress=false",
    "runner.n=4",
    "algo.steps=3",
    "algo.batch_size=2",
    "algo.group_size=2",
    "algo.eval_every=0",
    "task.max_tokens=4",
    "task.eval_size=2",
    "task.agent=e2e_agents:paced_hello_agent",
]
NOISE = ("Traceback", "Warning", "warnings.warn")  # a normal run's log carries no warning of agl's


def env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "tests"), **extra}


def wait_for(predicate, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_a_second_harness_on_a_live_run_is_refused_and_a_killed_ones_run_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "harness.py", *TINY_GRPO, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env(
            AGL_TEST_FAST_ROLLOUTS="6", AGL_TEST_SLOW_S="60"
        ),  # the baseline (2), step 0 (4), then it stays in step 1
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: 0 in metric_steps(run_dir) or first.poll() is not None, what="the first job's step 0")
        assert first.poll() is None, first.stdout.read()[-3000:]

        second = run_harness(f"resume={run_dir}", timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        [line] = second.stderr.strip().splitlines()
        assert line.startswith(f"error: {run_dir} is held by a live job (pid {first.pid}: harness.py "), line
        assert f"algo=runner attach={run_dir}" in line and "Traceback" not in second.stdout + second.stderr
        assert json.loads((run_dir / "status.json").read_text())["pid"] == first.pid  # the refused one wrote nothing
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)

    third = run_harness(f"resume={run_dir}")
    assert third.returncode == 0, third.stderr[-3000:]
    assert (
        f"continuing {run_dir} (status was running; its job, pid {first.pid}, is gone) from its store" in third.stdout
    )
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "succeeded" and status["pid"] != first.pid
    assert metric_steps(run_dir) == [-1, 0, 1, 2]  # every step once: never two trainers on one run
    for noise in NOISE:
        assert noise not in third.stdout + third.stderr, third.stdout + third.stderr


def test_a_sweep_skips_a_job_dir_another_process_holds(tmp_path):
    sweep = tmp_path / "sweep"
    held = sweep / "job0"
    with holding_run_dir(held):  # this test's process holds job 0, as a live job of another sweep would
        result = run_harness(
            "-m", *TINY_GRPO, "seed=1,2", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=job${hydra.job.num}"
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"skip: {held} is held by a live job (pid {os.getpid()}); this sweep leaves it to that job" in result.stdout
    assert not (held / "store.sqlite").exists() and not (held / "status.json").exists()
    assert json.loads((sweep / "job1" / "status.json").read_text())["status"] == "succeeded"
