"""Damaged files: a truncated or garbled store, checkpoint or adapter is one line naming the file and what to
do, and agl never writes over it (a fresh store there would silently start the run over).

Each test damages a copy of a finished tiny run (``tiny_grpo_run``, tests/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from conftest import run_harness

from agl.errors import ConfigError
from agl.policy.lora import find_adapter_dir
from agl.report.run_report import report
from agl.report.status import write_status
from agl.store import SqliteStore, StoreDamaged


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def run_copy(tiny_grpo_run, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_grpo_run, run_dir)
    return run_dir


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:16] = b"\x00garbled-bytes\x00\x00"
    path.write_bytes(bytes(data))


def garble_pages(path: Path) -> None:
    """Every page but the first (the header and schema) overwritten with noise: the tables' b-trees are gone."""
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    noise = hashlib.sha256(b"noise").digest() * (len(data) // 32 + 1)
    data[page:] = noise[: len(data) - page]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, garble_header, garble_pages])
async def test_a_damaged_store_is_one_line_and_left_as_it_is(run_copy, damage):
    path = run_copy / "store.sqlite"
    damage(path)
    before = digest(path)
    with pytest.raises(StoreDamaged) as error:
        store = await SqliteStore.open(path)
        try:  # damage deep in the pages shows when they are read
            await store.query_rollouts()
            await store.load_checkpoint()
        finally:
            await store.close()
    [line] = str(error.value).splitlines()
    assert line.startswith(f"{path} is damaged (") and line.endswith(
        f"agl does not write over it: restore it from a copy, or move it aside (mv {path} {path}.damaged) "
        "and run again to start over"
    ), line
    with pytest.raises(StoreDamaged):
        report(run_copy)  # report= reads it read-only: the same line
    assert digest(path) == before  # not re-initialised, not repaired, not touched


def test_a_damaged_checkpoint_is_one_line_naming_it(run_copy):
    with sqlite3.connect(run_copy / "store.sqlite") as conn:
        [(step,)] = conn.execute("SELECT max(step) FROM checkpoints").fetchall()
        conn.execute(  # the optimizer state cut in half
            "UPDATE checkpoint_blobs SET data = substr(data, 1, length(data) / 2) "
            "WHERE step = ? AND name = 'optimizer'",
            (step,),
        )
    write_status(run_copy, "running", pid=2**22 + 7)
    result = run_harness(f"resume={run_copy}")
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    store = run_copy / "store.sqlite"
    assert line.startswith(f"error: the checkpoint of step {step} in {store} is damaged (optimizer: "), line
    assert line.endswith(f"move it aside (mv {store} {store}.damaged) and run again to start over"), line
    with sqlite3.connect(store) as conn:  # still there, as it was: nothing rewrote it
        assert conn.execute("SELECT count(*) FROM checkpoints WHERE step = ?", (step,)).fetchone() == (1,)


@pytest.mark.parametrize("damage", [truncate, garble_header])
def test_a_damaged_adapter_is_one_line_naming_the_file(run_copy, damage):
    weights = run_copy / "adapter" / "adapter_model.safetensors"
    damage(weights)
    with pytest.raises(ConfigError) as error:
        find_adapter_dir(str(run_copy))
    [line] = str(error.value).splitlines()
    assert line.startswith(f"{weights} is damaged (") and line.endswith("restore the adapter from a copy"), line
    config = run_copy / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA"})[:-3])
    with pytest.raises(ConfigError, match=f"^{config} is damaged \\(not JSON: "):
        find_adapter_dir(str(run_copy / "adapter"))
