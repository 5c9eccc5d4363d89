"""``logger=tensorboard`` and ``logger=wandb`` (offline): what they got equals metrics.jsonl, also after a resume.

Each test trains the tiny model for two GRPO steps through harness.py, has the job die during its
last step, resumes it, and reads the logger's own files back (TensorBoard's EventAccumulator; the
records of W&B's offline run file).
"""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from agl.report.loggers import scalars
from agl.report.status import write_status

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [
    "model=tiny",
    "task=hello",
    "algo=grpo",
    "progress=false",
    "runner.n=4",
    "algo.steps=2",
    "algo.batch_size=2",
    "algo.group_size=2",
    "algo.eval_every=1",
    "task.max_tokens=4",
    "task.eval_size=2",
]


def harness(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    environ.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "harness.py", *args], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600
    )


def train(run_dir: Path, logger: str, env: dict | None = None) -> list[dict]:
    result = harness(*TRAIN, f"logger={logger}", f"hydra.run.dir={run_dir}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return metrics(run_dir)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def as_curves(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{name: [(step, value), ...]} of the numbers in metrics.jsonl rows, as the loggers get them."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in scalars(row).items():
            curves.setdefault(name, []).append((row["step"], value))
    return curves


def kill_during_last_step(run_dir: Path) -> None:
    """As if the job died before step 1's checkpoint committed (tests/test_sweep.py does the same)."""
    with sqlite3.connect(run_dir / "store.sqlite") as conn:
        for table in ("checkpoint_blobs", "checkpoints", "metrics"):
            conn.execute(f"DELETE FROM {table} WHERE step = 1")
    write_status(run_dir, "running", pid=2**22 + 12345, result=None)


def resume(run_dir: Path, env: dict | None = None) -> list[dict]:
    result = harness(f"resume={run_dir}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"continuing {run_dir}" in result.stdout
    return metrics(run_dir)


def assert_same_curves(logged: dict[str, list[tuple[int, float]]], rows: list[dict]) -> None:
    expected = as_curves(rows)
    assert set(logged) == set(expected)
    for name, points in expected.items():
        assert [s for s, _ in logged[name]] == [s for s, _ in points], name  # one point per step: no double logging
        assert [v for _, v in logged[name]] == pytest.approx([v for _, v in points], rel=1e-6, nan_ok=True), name


# ----------------------------------------------------------------------------- tensorboard


def tensorboard_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_equal_metrics_jsonl_and_a_resume_keeps_one_curve(tmp_path):
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra: pip install -e '.[tensorboard]' (make test installs it)"
    )
    run = tmp_path / "run"
    rows = train(run, "tensorboard")
    assert [r["step"] for r in rows] == [-1, 0, 1]
    assert {"reward_mean", "time_rollout_s", "eval/reward", "policy_version"} <= set(tensorboard_curves(run))
    assert_same_curves(tensorboard_curves(run), rows)

    kill_during_last_step(run)
    rows = resume(run)
    assert [r["step"] for r in rows] == [-1, 0, 1]
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # the resumed process wrote all steps again
    assert_same_curves(tensorboard_curves(run), rows)  # ... and TensorBoard shows each step once, the redone step 1's
    # values (its time_rollout_s differs from the first try's) and not the killed process's (purge_step)


# ----------------------------------------------------------------------------- wandb (offline)


def wandb_history(run_file: Path) -> list[dict]:
    """The history rows of a W&B offline run file (``run-<id>.wandb``): a LevelDB-style log of
    ``wandb_internal_pb2.Record`` protobufs, in 32 KiB blocks of records each with a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last), after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def wandb_curves(run_file: Path) -> dict[str, list[tuple[int, float]]]:
    """An offline run's history as curves over agl's step; W&B's own step must be agl's + 1."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in wandb_history(run_file):
        assert row["_step"] == row["step"] + 1, row
        for name, value in row.items():
            if not name.startswith("_") and name != "step":
                curves.setdefault(name, []).append((row["step"], value))
    return curves


KILL_AGENT = """
import itertools, os, signal, threading
from tasks.hello.agent import hello_agent

calls, lock = itertools.count(1), threading.Lock()


def agent(task, llm, prompt_template, **kwargs):
    with lock:
        n = next(calls)
    if str(n) == os.environ.get("AGL_TEST_KILL_AT_CALL"):  # SIGKILL: no cleanup, no flush, as in an OOM kill
        os.kill(os.getpid(), signal.SIGKILL)
    return hello_agent(task, llm, prompt_template, **kwargs)
"""


def test_wandb_offline_history_equals_metrics_jsonl_also_after_a_kill_and_resume(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra: pip install -e '.[wandb]' (make test installs it)")
    (tmp_path / "kill_agent.py").write_text(KILL_AGENT)
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": str(tmp_path)}
    run = tmp_path / "run"
    # calls 1-2: the baseline eval; 3-6: step 0's rollouts; 7-8: the eval after step 0; 9: step 1's first rollout
    killed = harness(
        *TRAIN,
        "task.agent=kill_agent:agent",
        "logger=wandb",
        f"hydra.run.dir={run}",
        env={**env, "AGL_TEST_KILL_AT_CALL": "9"},
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [-1, 0]

    rows = resume(run, env)
    assert [r["step"] for r in rows] == [-1, 0, 1]
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1  # one W&B run id, resumed
    [latest] = (run / "wandb" / "latest-run").glob("run-*.wandb")
    assert latest.resolve().parent == runs[-1].resolve()
    curves = wandb_curves(latest)
    assert {"reward_mean", "eval/reward", "policy_version"} <= set(curves)
    assert_same_curves(curves, rows)  # the newest offline dir holds the whole run, each step once


# ----------------------------------------------------------------------------- bad input


def test_unknown_logger_is_a_one_line_config_error(tmp_path):
    result = harness("model=tiny", "task=hello", "algo=grpo", "logger=tensorbaord", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr
    assert "error: logger=tensorbaord: no such logger; known: tensorboard, wandb" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "store.sqlite").exists()  # refused before the job started its store
