"""Sweeps: deterministic dirs, the end-of-sweep summary, failure isolation and resume (Hydra multirun)."""

import csv
import json
import os
import sqlite3
from pathlib import Path

import prefork

import agl
from agl.report.status import write_status
from agl.report.sweep import command_overrides, job_dir_name, sweep_id, write_sweep_summary

ROOT = Path(__file__).resolve().parents[1]


def test_the_same_command_gives_the_same_dirs():
    a = sweep_id(["-m", "task=hello", "algo=grpo", "algo.lr=1e-5,3e-5", "progress=false"])
    b = sweep_id(["algo.lr=1e-5,3e-5", "-m", "algo=grpo", "task=hello", "hydra.sweep.dir=x", "device=cpu"])
    assert a == b and a.startswith("hello_grpo_")
    assert sweep_id(["task=hello", "algo=grpo", "algo.lr=1e-5"]) != a
    assert command_overrides(["-m", "b=1", "+a=2", "hydra/launcher=joblib", "resume=x"]) == ["+a=2", "b=1"]
    assert (
        job_dir_name("algo.lr-1e-05+model.adapter-runs/a/b+task.agent-m\\:f")
        == "algo.lr-1e-05+model.adapter-runs_a_b+task.agent-m_f"
    )
    long = job_dir_name("x=" + "y" * 300)
    assert len(long) < 200 and long != job_dir_name("x=" + "y" * 299)
    assert job_dir_name("") == "defaults"


def _job(sweep, name, overrides, status, metrics=None, **fields):
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    write_status(job, status, **fields)
    if metrics:
        (job / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return job


def test_summary_table_csv_and_plot(tmp_path):
    common = ["task=hello", "algo=grpo"]
    _job(
        tmp_path,
        "a",
        common + ["algo.lr=0.01"],
        "succeeded",
        duration_s=12.5,
        metrics=[
            {"step": -1, "eval/reward": 0.1, "eval/n": 8.0, "eval/says_identity": 0.0},
            {"step": 0, "reward_mean": 0.2},
            {"step": 1, "reward_mean": 0.6, "eval/reward": 0.7, "eval/says_identity": 0.5},
            {"step": 2, "reward_mean": 0.4, "eval/reward": 0.5, "eval/says_identity": 0.25},
        ],
    )
    _job(tmp_path, "b", common + ["algo.lr=0.02"], "failed", error="ConfigError: cannot import 'x:y'\nmore")
    _job(tmp_path, "c", common + ["algo.lr=0.03"], "running", pid=2**22 + 12345)  # killed: its process is gone
    summary = write_sweep_summary(tmp_path, echo=False)
    jobs = {j["job"]: j for j in summary["jobs"]}
    assert [jobs[k]["status"] for k in "abc"] == ["succeeded", "failed", "unfinished"]
    a = jobs["a"]["metrics"]
    assert a["steps"] == 3 and a["final reward"] == 0.4 and a["best reward"] == 0.6
    assert a["final eval/reward"] == 0.5 and a["best eval/reward"] == 0.7 and a["best step"] == 1
    assert a["final eval/says_identity"] == 0.25 and "final eval/n" not in a

    md = (tmp_path / "summary.md").read_text()
    assert "3 jobs: 1 failed, 1 succeeded, 1 unfinished" in md
    assert "common overrides: algo=grpo task=hello" in md
    assert "| algo.lr |" in md and "cannot import 'x:y'" in md and "more" not in md
    with open(tmp_path / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["a", "b", "c"] and rows[0]["algo.lr"] == "0.01" and rows[0]["task"] == "hello"
    assert rows[0]["best eval/reward"] == "0.7" and rows[1]["status"] == "failed" and rows[1]["best eval/reward"] == ""
    assert (tmp_path / "curves.png").is_file()


def _sweep(cwd, pythonpath):
    """A 2-job sweep on the basic launcher (one job after the other, in this command's process, forked:
    tests/prefork.py): one GRPO step of 2 rollouts each, and one eval task before and after."""
    args = [
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
        "task.agent=tasks.hello.agent:hello_agent,late_agent:hello_agent",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(pythonpath)}
    result = prefork.run(args, env, timeout=600, cwd=cwd)  # forked: tests/prefork.py
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def _store(job):
    with sqlite3.connect(job / "store.sqlite") as conn:
        return (
            {r[0] for r in conn.execute("SELECT step FROM checkpoints")},
            {r[0] for r in conn.execute("SELECT rollout_id FROM rollouts")},
        )


def test_multirun_isolates_a_failing_job_and_rerunning_resumes_or_skips(tmp_path, capsys):
    """Re-running a sweep, tested here once: agl's logic (agl/report/sweep.py, agl/jobs/dispatch.py), the same on
    every launcher (tests/test_launchers.py runs one sweep on each)."""
    modules = tmp_path / "modules"
    modules.mkdir()
    # 1. job "late_agent" fails (its module does not exist yet); the other job still runs
    out = _sweep(tmp_path, modules)
    [sweep] = list((tmp_path / "outputs" / "multirun").iterdir())
    assert sweep.name.startswith("hello_grpo_")
    good, bad = sorted((d for d in sweep.iterdir() if d.is_dir()), key=lambda d: "late_agent" in d.name)
    assert json.loads((good / "status.json").read_text())["status"] == "succeeded"
    failed = json.loads((bad / "status.json").read_text())
    assert (
        failed["status"] == "failed"
        and "late_agent" in failed["error"]
        and "Traceback" in (bad / "error.log").read_text()
    )
    md = (sweep / "summary.md").read_text()
    assert "2 jobs: 1 failed, 1 succeeded" in md and "No module named 'late_agent'" in md
    assert len(list(csv.DictReader(open(sweep / "summary.csv")))) == 2 and out.count("written: ") == 1

    # 2. make the good job look killed during its (last and only) step, after its rollouts finished and before
    # the step's checkpoint; make the failing job's agent exist
    checkpoints, rollouts = _store(good)
    assert checkpoints == {0}
    with sqlite3.connect(good / "store.sqlite") as conn:
        conn.execute("DELETE FROM checkpoint_blobs WHERE step = 0")
        conn.execute("DELETE FROM checkpoints WHERE step = 0")
        conn.execute("DELETE FROM metrics WHERE step = 0")
    write_status(good, "running", pid=2**22 + 12345, result=None)
    (modules / "late_agent.py").write_text("from tasks.hello.agent import hello_agent\n")
    out = _sweep(tmp_path, modules)
    assert f"continuing {good}" in out and f"continuing {bad}" in out
    assert _store(good) == ({0}, rollouts)  # step 0 and both evals redone from their finished rollouts: none again
    lines = [json.loads(line) for line in (good / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [-1, 0]
    assert all(json.loads((d / "status.json").read_text())["status"] == "succeeded" for d in (good, bad))
    assert "2 jobs: 2 succeeded" in (sweep / "summary.md").read_text() and out.count("written: ") == 1

    # 3. the same command once more: everything is finished, nothing runs
    out = _sweep(tmp_path, modules)
    assert out.count("skip: ") == 2 and _store(good) == ({0}, rollouts)
    assert list((tmp_path / "outputs" / "multirun").iterdir()) == [sweep]

    # 4. report=<sweep dir> rewrites the summary from the files; report=<job dir> needs no quoting (the report job,
    # in this process: its overrides go through Hydra's override parser as the command line's do)
    (sweep / "summary.md").unlink()
    capsys.readouterr()
    agl.run(f"report={sweep}")
    assert "2 jobs: 2 succeeded" in capsys.readouterr().out and (sweep / "summary.md").is_file()
    agl.run(f"report={good}")
    report = capsys.readouterr().out
    assert "## best step" in report and "1 of 1 done" in report
