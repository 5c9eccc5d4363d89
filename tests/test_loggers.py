"""``logger=tensorboard`` and ``logger=wandb`` (offline): what they got equals metrics.jsonl, also after a resume.

One job with both loggers: the reference run (tests/runs.py) with another seed, killed right after its
first GRPO update (before that step's checkpoint: tests/crash_points.py), then resumed. The loggers'
own files are read back (TensorBoard's EventAccumulator; the records of W&B's offline run file). It is
also the test that another seed gives another run.
"""

from __future__ import annotations

import json
import signal
import struct
from pathlib import Path

import pytest
from runs import RUN, STEPS, adapter, all_metrics, finish, harness

from agl import run as run_in_process
from agl.errors import ConfigError
from agl.report.loggers import scalars


def as_curves(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{name: [(step, value), ...]} of the numbers in metrics.jsonl rows, as the loggers get them."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in scalars(row).items():
            curves.setdefault(name, []).append((row["step"], value))
    return curves


def assert_same_curves(logged: dict[str, list[tuple[int, float]]], rows: list[dict]) -> None:
    expected = as_curves(rows)
    assert set(logged) == set(expected)
    for name, points in expected.items():
        assert [s for s, _ in logged[name]] == [s for s, _ in points], name  # one point per step: no double logging
        assert [v for _, v in logged[name]] == pytest.approx([v for _, v in points], rel=1e-6, nan_ok=True), name


def tensorboard_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


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


def test_another_seed_with_both_loggers_killed_and_resumed(reference, tmp_path, device):
    pytest.importorskip("tensorboard", reason="the tensorboard extra: pip install -e '.[tensorboard]'")
    pytest.importorskip("wandb", reason="the wandb extra: pip install -e '.[wandb]'")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run = tmp_path / "run"
    args = [*RUN, "runner.n=8", "seed=4", "logger=[tensorboard,wandb]"]
    killed = harness(*args, f"hydra.run.dir={run}", kill="update", device=device, env=env)
    out, _ = killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL, out[-3000:]
    assert [r["step"] for r in all_metrics(run)] == [-1, 0]  # the baseline and the SFT step; step 1 never committed
    assert "continuing" in finish(harness(f"resume={run}", env=env))
    rows = all_metrics(run)
    assert [r["step"] for r in rows] == list(range(-1, STEPS))
    assert adapter(run) != adapter(reference)  # another seed, another run

    # TensorBoard: the resumed process wrote every step again, and purge_step hides the killed one's events
    assert len(list(run.glob("events.out.tfevents.*"))) == 2
    logged = tensorboard_curves(run)
    assert {"reward_mean", "time_rollout_s", "eval/reward", "policy_version", "sft_loss"} <= set(logged)
    assert_same_curves(logged, rows)

    # W&B offline: one run id over both processes; the newest offline dir holds the whole run, each step once
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1
    [latest] = (run / "wandb" / "latest-run").glob("run-*.wandb")
    assert latest.resolve().parent == runs[-1].resolve()
    curves = wandb_curves(latest)
    assert {"reward_mean", "eval/reward", "policy_version"} <= set(curves)
    assert_same_curves(curves, rows)


def test_unknown_logger_is_a_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError) as error:
        run_in_process("model=tiny", "task=hello", "algo=grpo", "logger=tensorbaord", run_dir=tmp_path / "run")
    assert (
        str(error.value)
        == "logger=tensorbaord: no such logger; known: tensorboard, wandb (or null for metrics.jsonl only)"
    )
    assert not (tmp_path / "run" / "store.sqlite").exists()  # refused before the job started its store
