"""A full disk, for real: a run on a size-limited tmpfs fails for space, says so in one line, keeps its store
and last checkpoint whole, and, once the filesystem is given room, resumes to the uninterrupted run's bytes.

The filesystem is a real tmpfs mounted with ``size=`` (so the ENOSPC comes from the kernel, into SQLite's
writes and agl's alike): that needs root (``mount``). Without it the test is skipped, saying so; agl's
own handling of a full disk (``agl.errors.DiskFull``) is the same code either way. ``RLIMIT_FSIZE`` would
not do: it gives EFBIG and SIGXFSZ, not ENOSPC.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import TINY_GRPO_RUN, run_harness
from safetensors.torch import load as load_safetensors

# Room for the run's first checkpoint (step 0) and not for the whole run (measured: ~3.4 MB of WAL by the end
# of step 0 on this config, ~6 MB at the end); a different config needs another size.
SIZE = "3500k"


def mount_tmpfs(where: Path, size: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-limited tmpfs needs root")
    where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    try:
        mount_tmpfs(where, SIZE)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot mount a tmpfs here: {error}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def costless(run_dir: Path) -> list[dict]:
    """metrics.jsonl without what a process measures about itself (times, memory, prefill counts)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {
            k: v
            for k, v in r.items()
            if not (k.startswith("time_") or k.endswith(("_s", "_mib")) or k == "prompt_tokens")
        }
        for r in rows
    ]


def test_a_run_that_fills_its_disk_stops_in_one_line_and_resumes_to_the_same_bytes(tiny_grpo_run, small_disk):
    run_dir = small_disk / "run"
    failed = run_harness(*TINY_GRPO_RUN, f"hydra.run.dir={run_dir}")
    assert failed.returncode == 2, failed.stdout[-2000:] + failed.stderr[-3000:]
    lines = [line for line in failed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, failed.stderr[-5000:]
    [line] = lines
    assert line.startswith("error: no space left on the device holding "), line
    assert f"{run_dir}/" in line and " free): the job stopped" in line, line  # the path written, the space left
    assert line.endswith(f"then python harness.py resume={run_dir}"), line
    assert "Traceback" not in failed.stdout + failed.stderr

    with sqlite3.connect(run_dir / "store.sqlite") as conn:  # the store: whole, its last checkpoint loadable
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        [(step, adapter)] = conn.execute(
            "SELECT step, data FROM checkpoint_blobs WHERE name = 'adapter' ORDER BY step DESC LIMIT 1"
        ).fetchall()
    assert step >= 0 and load_safetensors(adapter)

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space freed
    resumed = run_harness(f"resume={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (run_dir / "adapter" / "adapter_model.safetensors").read_bytes() == (
        tiny_grpo_run / "adapter" / "adapter_model.safetensors"
    ).read_bytes()
    assert costless(run_dir) == costless(tiny_grpo_run)
