"""Sweeps on Hydra's launcher plugins (the `launchers` extra): jobs in parallel processes, each with
its share of the cores, the summary once at the end, a failing job kept local, re-runs resuming.

SLURM and Ray need a cluster: for them the composed launcher config and agl's thread count for it
are tested (README "Sweeps" has the overrides).
"""

from __future__ import annotations

import csv
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from agl.errors import ConfigError
from agl.jobs.launchers import BASIC_SWEEPER, auto_threads, launcher_names, sweep_batch_size, thread_count, usable_cores
from agl.report.status import write_status

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
CORES = usable_cores()

# The agent of the sweep's jobs: hello's, and the torch threads of the job's process as an eval metric
# (agents run in worker threads of the job: torch's setting is the process's).
PROBE_AGENT = """
import agl
import torch
from tasks.hello.agent import hello_agent


def agent(task, llm, prompt_template, **kwargs):
    agl.emit_metric("torch_threads", float(torch.get_num_threads()))
    return hello_agent(task, llm, prompt_template, **kwargs)
"""
LAUNCHERS = {
    "joblib": (["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], 2),  # (overrides, jobs at once)
    "submitit_local": (["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"], 4),
}


def sweep(
    cwd: Path,
    launcher: list[str],
    sweep_overrides: tuple[str, ...] = ("seed=0,1", "task.agent=probe_agent:agent,late_agent:agent"),
    env: dict | None = None,
    ok: bool = True,
) -> subprocess.CompletedProcess:
    """By default a 2x2 sweep: seed=0,1 x an agent that imports and one (late_agent) that does not exist yet."""
    args = [
        sys.executable,
        str(ROOT / "harness.py"),
        "-m",
        "model=tiny",
        "task=hello",
        "algo=grpo",
        "progress=false",
        "runner.n=4",
        "algo.steps=1",
        "algo.batch_size=2",
        "algo.group_size=2",
        "algo.eval_every=0",
        "task.max_tokens=4",
        "task.eval_size=2",
        *sweep_overrides,
        *launcher,
    ]
    environ = {
        k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "HYDRA_FULL_ERROR")
    }
    environ["PYTHONPATH"] = str(
        cwd
    )  # the agents' modules; tasks/ comes from the checkout (harness.py puts it on sys.path)
    result = subprocess.run(args, cwd=cwd, env={**environ, **(env or {})}, capture_output=True, text=True, timeout=900)
    assert (result.returncode == 0) == ok, result.stderr[-3000:]
    return result


def statuses(sweep_dir: Path) -> dict[str, dict]:
    return {
        d.name: json.loads((d / "status.json").read_text())
        for d in sweep_dir.iterdir()
        if (d / "status.json").is_file()
    }


def rollout_ids(job: Path) -> set[str]:
    with sqlite3.connect(job / "store.sqlite") as conn:
        return {r[0] for r in conn.execute("SELECT rollout_id FROM rollouts")}


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_launcher_sweep_runs_jobs_in_parallel_with_their_share_of_cores_and_resumes(tmp_path, name):
    pytest.importorskip(
        {"joblib": "hydra_plugins.hydra_joblib_launcher", "submitit_local": "hydra_plugins.hydra_submitit_launcher"}[
            name
        ],
        reason="the launchers extra: pip install -e '.[launchers]' (make test installs it)",
    )
    launcher, at_once = LAUNCHERS[name]
    (tmp_path / "probe_agent.py").write_text(PROBE_AGENT)
    first = sweep(tmp_path, launcher)
    [sweep_dir] = list((tmp_path / "outputs" / "multirun").iterdir())
    jobs = statuses(sweep_dir)
    assert len(jobs) == 4

    # parallel processes: distinct pids, and jobs that ran at the same time
    good = {k: v for k, v in jobs.items() if "probe_agent" in k}
    bad = {k: v for k, v in jobs.items() if "late_agent" in k}
    assert (
        len({j["pid"] for j in jobs.values()} | {os.getpid()}) >= 3
    )  # at least 2 job processes, none of them this one
    overlapping = [
        (a, b)
        for a in jobs
        for b in jobs
        if a < b
        and jobs[a]["pid"] != jobs[b]["pid"]
        and jobs[a]["started"] < jobs[b]["ended"]
        and jobs[b]["started"] < jobs[a]["ended"]
    ]
    assert overlapping, {k: (j["pid"], j["started"], j["ended"]) for k, j in jobs.items()}

    # each job's threads: the cores shared among the jobs run at once, and torch in the job used that many
    expected = max(1, CORES // at_once)
    assert {j["threads"] for j in jobs.values()} == {expected}
    for job in good:
        rows = [json.loads(line) for line in (sweep_dir / job / "metrics.jsonl").read_text().splitlines()]
        assert rows[0]["eval/torch_threads"] == expected

    # a failing job stays local; the summary, written once when all were back, shows both kinds
    assert {j["status"] for j in good.values()} == {"succeeded"}
    assert {j["status"] for j in bad.values()} == {"failed"} and all("late_agent" in j["error"] for j in bad.values())
    assert first.stdout.count("written: ") == 1
    md = (sweep_dir / "summary.md").read_text()
    assert "4 jobs: 2 failed, 2 succeeded" in md and "No module named 'late_agent'" in md
    assert (sweep_dir / "summary.md").stat().st_mtime >= max(j["ended"] for j in jobs.values())
    assert len(list(csv.DictReader(open(sweep_dir / "summary.csv")))) == 4 and (sweep_dir / "curves.png").is_file()

    # the same command again: failed and killed jobs continue from their stores, finished ones are skipped
    killed, finished = sorted(good)
    write_status(sweep_dir / killed, "running", pid=2**22 + 12345)  # its process is gone
    rollouts = rollout_ids(sweep_dir / killed)
    (tmp_path / "late_agent.py").write_text("from probe_agent import agent  # noqa: F401\n")
    second = sweep(tmp_path, launcher)
    after = statuses(sweep_dir)
    assert {j["status"] for j in after.values()} == {"succeeded"}
    assert after[finished]["started"] == jobs[finished]["started"]  # skipped
    assert (
        after[killed]["started"] > jobs[killed]["started"] and rollout_ids(sweep_dir / killed) == rollouts
    )  # resumed, nothing redone
    assert all(after[b]["started"] > jobs[b]["started"] for b in bad)
    assert second.stdout.count("written: ") == 1 and "4 jobs: 4 succeeded" in (sweep_dir / "summary.md").read_text()
    assert list((tmp_path / "outputs" / "multirun").iterdir()) == [sweep_dir]


KILL_AGENT = """
import os, signal
from tasks.hello.agent import hello_agent


def agent(task, llm, prompt_template, **kwargs):
    if os.environ.get("AGL_TEST_KILL"):  # SIGKILL, as the kernel's OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    return hello_agent(task, llm, prompt_template, **kwargs)
"""


def test_a_job_process_killed_stops_joblib_but_the_summary_is_written_and_the_command_resumes(tmp_path):
    """joblib gives up on a sweep whose worker process died (and stops the other workers): the
    summary still says what the job dirs say, and the same command runs the jobs to the end."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="the launchers extra")
    (tmp_path / "kill_agent.py").write_text(KILL_AGENT)
    (tmp_path / "probe_agent.py").write_text(PROBE_AGENT)
    launcher, jobs = LAUNCHERS["joblib"][0], ("task.agent=kill_agent:agent,probe_agent:agent",)
    first = sweep(tmp_path, launcher, jobs, env={"AGL_TEST_KILL": "1"}, ok=False)
    [sweep_dir] = list((tmp_path / "outputs" / "multirun").iterdir())
    assert "the launcher stopped before every job was back" in first.stderr
    md = (sweep_dir / "summary.md").read_text()
    assert md.startswith(f"# sweep: outputs/multirun/{sweep_dir.name}") and "2 jobs:" in md and "unfinished" in md

    second = sweep(tmp_path, launcher, jobs)
    assert {j["status"] for j in statuses(sweep_dir).values()} == {"succeeded"}
    assert second.stdout.count("written: ") == 1 and "2 jobs: 2 succeeded" in (sweep_dir / "summary.md").read_text()


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


def test_slurm_launcher_config_composes_and_cpus_per_task_bounds_the_threads(tmp_path):
    """What can be checked of SLURM here: the README's overrides compose, and a job takes the cores of its
    allocation."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the launchers extra")
    overrides = [
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=cpu",
        "hydra.launcher.cpus_per_task=4",
        "hydra.launcher.mem_gb=16",
        "hydra.launcher.timeout_min=240",
        "hydra.launcher.array_parallelism=8",
    ]
    result = subprocess.run(
        [sys.executable, "harness.py", "task=hello", "algo=grpo", *overrides, "--cfg", "hydra", "-p", "hydra.launcher"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = OmegaConf.create(result.stdout.split("\n", 1)[1])  # after "# @package hydra.launcher"
    assert printed._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (
        printed.partition,
        printed.cpus_per_task,
        printed.mem_gb,
        printed.timeout_min,
        printed.array_parallelism,
    ) == ("cpu", 4, 16, 240, 8)
    assert "submitit_folder: ${hydra.sweep.dir}/.submitit/%j" in result.stdout  # job logs under the sweep dir

    slurm = hydra_config(*overrides)
    assert auto_threads(slurm, 4, batch=100)[0] == 4  # an allocation of its own: not divided by the sweep's jobs
    assert auto_threads(slurm, 16, batch=100)[0] == 4  # cpus_per_task bounds a node's cores


def test_threads_setting():
    cfg = OmegaConf.create({"threads": 3})
    assert thread_count(cfg, None) == (3, "threads setting")
    for bad in (0, -1, "many", 1.5, True):
        with pytest.raises(ConfigError, match="threads="):
            thread_count(OmegaConf.create({"threads": bad}), None)


# ----------------------------------------------------------------------------- bad input


def test_a_launcher_that_is_not_there_is_a_one_line_config_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    for name, expected in (
        ("jobslib", "no such launcher"),
        ("ray", "that launcher's plugin is not installed (pip install hydra-ray-launcher)"),
    ):
        if name in launcher_names(CONF):
            continue  # ray's plugin installed: nothing to refuse
        result = subprocess.run(
            [sys.executable, str(ROOT / "harness.py"), "-m", "task=hello", f"hydra/launcher={name}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: hydra/launcher={name}: {expected}"), result.stderr
        assert "available here: basic" in lines[0] and not (tmp_path / "outputs").exists()
