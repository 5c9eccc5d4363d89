"""Sweeps on Hydra's launcher plugins (the `launchers` extra): jobs in parallel processes, each with
its share of the cores, the summary once at the end, a failing job kept local, a killed job process
still summarized.

One 2-job sweep per launcher. Re-running a sweep (finished jobs skipped, failed and killed ones
resumed) is agl's logic, not a launcher's: tests/test_sweep.py runs it once, on the basic launcher.
SLURM and Ray need a cluster: for them the composed launcher config and agl's thread count for it
are tested (docs/running.md "Sweeps" and docs/gpu.md "Clusters" have the overrides).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from agl.config import check_command_line
from agl.errors import ConfigError
from agl.jobs.launchers import (
    BASIC_SWEEPER,
    auto_threads,
    check_launcher,
    launcher_names,
    sweep_batch_size,
    thread_count,
    usable_cores,
)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
CORES = usable_cores()

# The agent of the sweep's good job: hello's, and the torch threads of the job's process as an eval metric
# (agents run in worker threads of the job: torch's setting is the process's).
PROBE_AGENT = """
import agl
import torch
from tasks.hello.agent import hello_agent


def agent(task, llm, prompt_template, **kwargs):
    agl.emit_metric("torch_threads", float(torch.get_num_threads()))
    return hello_agent(task, llm, prompt_template, **kwargs)
"""
# The other job's agent module waits, as it is imported (early in the job), until the probe job has started
# (it runs, or it has ended already), then ends its job: so both job dirs exist when it ends, and the two jobs
# overlap if, and only if, the launcher runs them at once (the check reads their start and end times). A probe
# that has ended is not waited for: waiting could not make the jobs overlap any more (under load, the probe job
# may end before this one's process has started; it once cost a test the wait's whole 5 minutes).
WAIT_FOR_PROBE = """
import json
import time
from pathlib import Path


def started(status):
    try:
        return json.loads(status.read_text())["status"] in ("running", "succeeded", "failed")
    except (OSError, ValueError):  # not written yet
        return False


deadline = time.time() + 300  # a loaded machine can take minutes to start a job process
sweeps = Path(__file__).parent / "outputs" / "multirun"
while time.time() < deadline and not any(started(s) for s in sweeps.glob("*/*probe_agent*/status.json")):
    time.sleep(0.05)
"""
FAILING_AGENT = WAIT_FOR_PROBE + 'raise RuntimeError("failing_agent fails its job")\n'
KILL_AGENT = (
    WAIT_FOR_PROBE + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer does\n"
)
LAUNCHERS = {
    "joblib": (["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], 2),  # (overrides, jobs at once)
    "submitit_local": (["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"], 2),
}


def sweep(cwd: Path, launcher: list[str], agents: str, ok: bool = True) -> subprocess.CompletedProcess:
    """A 2-job sweep over ``task.agent``: a short GRPO run each (one step of 2 rollouts)."""
    for name, source in (("probe_agent", PROBE_AGENT), ("failing_agent", FAILING_AGENT), ("kill_agent", KILL_AGENT)):
        (cwd / f"{name}.py").write_text(source)
    args = [
        sys.executable,
        str(ROOT / "harness.py"),
        "-m",
        "model=tiny",
        "task=hello",
        "algo=grpo",
        "progress=false",
        "runner.n=2",
        "algo.steps=1",
        "algo.batch_size=1",
        "algo.group_size=2",
        "algo.eval_every=0",
        "task.max_tokens=2",
        "task.eval_size=1",
        f"task.agent={agents}",
        *launcher,
    ]
    environ = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HYDRA_FULL_ERROR")
    }
    # the agents' modules, and this checkout's agl and tasks/: submitit's job processes unpickle the job function
    # without running harness.py (which puts the checkout first on sys.path), so they would import agl from wherever
    # the venv installed it (another checkout, in a venv shared by worktrees)
    environ["PYTHONPATH"] = os.pathsep.join([str(cwd), str(ROOT)])
    result = subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=900)
    assert (result.returncode == 0) == ok, result.stderr[-3000:]
    return result


def statuses(sweep_dir: Path) -> dict[str, dict]:
    return {
        d.name: json.loads((d / "status.json").read_text())
        for d in sweep_dir.iterdir()
        if (d / "status.json").is_file()
    }


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_sweep_runs_jobs_in_parallel_with_their_share_of_cores(tmp_path, name):
    pytest.importorskip(
        {"joblib": "hydra_plugins.hydra_joblib_launcher", "submitit_local": "hydra_plugins.hydra_submitit_launcher"}[
            name
        ],
        reason="the launchers extra: pip install -e '.[launchers]' (make test installs it)",
    )
    launcher, at_once = LAUNCHERS[name]
    first = sweep(tmp_path, launcher, "probe_agent:agent,failing_agent:agent")
    [sweep_dir] = list((tmp_path / "outputs" / "multirun").iterdir())
    jobs = statuses(sweep_dir)
    assert len(jobs) == 2
    [good] = [k for k in jobs if "probe_agent" in k]
    [bad] = [k for k in jobs if "failing_agent" in k]

    # parallel processes: distinct pids, none of them this one, and jobs that ran at the same time
    assert len({j["pid"] for j in jobs.values()} | {os.getpid()}) == 3
    assert jobs[good]["started"] < jobs[bad]["ended"] and jobs[bad]["started"] < jobs[good]["ended"], {
        k: (j["pid"], j["started"], j["ended"]) for k, j in jobs.items()
    }

    # each job's threads: the cores shared among the jobs run at once, and torch in the job used that many
    expected = max(1, CORES // at_once)
    assert {j["threads"] for j in jobs.values()} == {expected}
    rows = [json.loads(line) for line in (sweep_dir / good / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/torch_threads"] == expected

    # a failing job stays local; the summary, written once when all were back, shows both kinds
    assert jobs[good]["status"] == "succeeded"
    assert jobs[bad]["status"] == "failed" and "failing_agent fails its job" in jobs[bad]["error"]
    assert first.stdout.count("written: ") == 1
    md = (sweep_dir / "summary.md").read_text()
    assert "2 jobs: 1 failed, 1 succeeded" in md and "failing_agent fails its job" in md
    assert (sweep_dir / "summary.md").stat().st_mtime >= max(j["ended"] for j in jobs.values())
    assert len(list(csv.DictReader(open(sweep_dir / "summary.csv")))) == 2 and (sweep_dir / "curves.png").is_file()


def test_a_job_process_killed_stops_joblib_but_the_summary_is_written(tmp_path):
    """joblib gives up on a sweep whose worker process died (and stops the other workers): the
    summary still says what the job dirs say (the same command then resumes them: tests/test_sweep.py)."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="the launchers extra")
    first = sweep(tmp_path, LAUNCHERS["joblib"][0], "kill_agent:agent,probe_agent:agent", ok=False)
    [sweep_dir] = list((tmp_path / "outputs" / "multirun").iterdir())
    assert "the launcher stopped before every job was back" in first.stderr
    md = (sweep_dir / "summary.md").read_text()
    assert md.startswith(f"# sweep: outputs/multirun/{sweep_dir.name}") and "2 jobs:" in md and "unfinished" in md


# ----------------------------------------------------------------------------- threads per launcher


def hydra_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True).hydra


def test_auto_threads_share_the_cores_among_the_jobs_run_at_once():
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="the launchers extra")
    assert auto_threads(None, 8)[0] == 8  # no sweep: every core
    assert auto_threads(hydra_config(), 8, batch=4)[0] == 8  # the basic launcher: one job at a time
    joblib = hydra_config("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert auto_threads(joblib, 8, batch=4)[0] == 4
    assert auto_threads(joblib, 8, batch=1)[0] == 8  # one job: n_jobs does not matter
    assert auto_threads(hydra_config("hydra/launcher=joblib"), 8, batch=16)[0] == 1  # n_jobs=-1: every core runs a job
    assert (
        auto_threads(hydra_config("hydra/launcher=joblib", "hydra.launcher.n_jobs=-2"), 8, batch=16)[0] == 1
    )  # 7 jobs
    local = hydra_config("hydra/launcher=submitit_local")
    assert auto_threads(local, 8, batch=2)[0] == 4 and auto_threads(local, 8, batch=None)[0] == 1
    assert auto_threads(joblib, 8, user_omp="3", batch=2)[0] == 3  # the user's OMP_NUM_THREADS caps it


def test_the_jobs_of_a_sweep_are_counted_from_its_multirun_yaml(tmp_path):
    def master(max_batch_size=None, params=None):
        OmegaConf.save(
            {
                "hydra": {
                    "sweeper": {"_target_": BASIC_SWEEPER, "max_batch_size": max_batch_size, "params": params},
                    "overrides": {"task": ["task=hello", "seed=range(3)", "algo.lr=1e-4,2e-4"]},
                }
            },
            tmp_path / "multirun.yaml",
        )

    job = hydra_config(f"hydra.sweep.dir={tmp_path}")
    assert sweep_batch_size(job) is None  # no multirun.yaml: unknown
    master()
    assert sweep_batch_size(job) == 6
    master(max_batch_size=4)
    assert sweep_batch_size(job) == 4  # the basic sweeper launches 4, then 2
    master(params={"algo.beta": "0.0,0.1"})
    assert sweep_batch_size(job) == 12


def test_slurm_launcher_config_composes_and_cpus_per_task_bounds_the_threads():
    """What can be checked of SLURM here: docs/gpu.md's overrides pass harness.py's checks and compose (what
    `harness.py ... --cfg hydra -p hydra.launcher` prints), and a job takes the cores of its allocation."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the launchers extra")
    overrides = [
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=cpu",
        "hydra.launcher.cpus_per_task=4",
        "hydra.launcher.mem_gb=16",
        "hydra.launcher.timeout_min=240",
        "hydra.launcher.array_parallelism=8",
    ]
    check_launcher(["-m", "task=hello", "algo=grpo", *overrides], CONF)  # what harness.py checks before Hydra
    check_command_line(["-m", "task=hello", "algo=grpo", *overrides], str(CONF))
    slurm = hydra_config("task=hello", "algo=grpo", *overrides)
    printed = slurm.launcher
    assert printed._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (
        printed.partition,
        printed.cpus_per_task,
        printed.mem_gb,
        printed.timeout_min,
        printed.array_parallelism,
    ) == ("cpu", 4, 16, 240, 8)
    assert "submitit_folder: ${hydra.sweep.dir}/.submitit/%j" in OmegaConf.to_yaml(printed)  # job logs in the sweep
    assert auto_threads(slurm, 4, batch=100)[0] == 4  # an allocation of its own: not divided by the sweep's jobs
    assert auto_threads(slurm, 16, batch=100)[0] == 4  # cpus_per_task bounds a node's cores


def test_threads_setting():
    cfg = OmegaConf.create({"threads": 3})
    assert thread_count(cfg, None) == (3, "threads setting")
    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(ConfigError, match="threads="):
            thread_count(OmegaConf.create({"threads": bad}), None)


# ----------------------------------------------------------------------------- bad input


def test_a_launcher_that_is_not_there_is_a_one_line_config_error():
    """harness.py calls check_launcher before Hydra runs (tests/test_harness.py runs the command line's
    one-line error): a missing launcher is one line naming it, not Hydra's page about search paths."""
    for name, expected in (
        ("jobslib", "no such launcher"),
        ("ray", "that launcher's plugin is not installed (pip install hydra-ray-launcher)"),
    ):
        if name in launcher_names(CONF):
            continue  # ray's plugin installed: nothing to refuse
        with pytest.raises(ConfigError) as error:
            check_launcher(["-m", "task=hello", f"hydra/launcher={name}"], CONF)
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"hydra/launcher={name}: {expected}"), message
        assert "available here: basic" in message
