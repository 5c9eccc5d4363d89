"""Fixtures shared by test modules."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see harness.py: set before torch loads
from pathlib import Path

import pytest
import pytest_asyncio
from omegaconf import OmegaConf
from store_helpers import FakeClock

from agl.config import register_configs
from agl.store import SqliteStore

register_configs()  # conf/ names the typed schemas (agl/config/schema.py): tests compose it with Hydra's compose API

# The tiny random-weight Llama with the real SmolLM2 tokenizer (conf/model/tiny.yaml, resolved:
# that file uses Hydra defaults, so it cannot be loaded on its own).
TINY_MODEL = {
    "name": "tiny",
    "path": "tiny",
    "cache_dir": "~/.cache/agl",
    "quantization": "nf4",
    "compute_dtype": "float32",
    "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "seed": 0,
    },
}


@pytest.fixture(scope="session")
def tiny_model_cfg():
    """The `model` config of the tiny policy: `load_policy(tiny_model_cfg, "cpu")`. Read-only."""
    return OmegaConf.create(TINY_MODEL)


# The store tests': a fake clock, a store file in tmp_path, and a store on both.
@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "store.sqlite"


@pytest_asyncio.fixture
async def store(path: Path, clock: FakeClock):
    s = SqliteStore(path, clock=clock, watchdog_interval=None)
    yield s
    await s.close()


# A small finished GRPO run (harness.py in a subprocess): a multi-turn agent through the route, a checkpoint per
# step. Read-only for its users: a test that damages or extends it works on a copy (shutil.copytree).
TINY_GRPO_RUN = [
    "model=tiny",
    "algo=grpo",
    "progress=false",
    "runner.n=8",
    "task=hello",
    "seed=3",
    "task.agent=crash_points:multi_turn_agent",
    "task.data=crash_points:load",
    "task.max_tokens=6",
    "+task.resources.max_turns=2",
    "task.eval_size=4",
    "algo.steps=3",
    "algo.eval_every=2",
    "algo.batch_size=2",
    "algo.group_size=4",
    "algo.micro_batch_size=4",
]


def run_harness(*args: str, timeout: float = 300):
    """``python harness.py *args`` from the checkout, tests/ importable (the agents above live there)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root / "tests")}
    return subprocess.run(
        [sys.executable, "harness.py", *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="session")
def tiny_grpo_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("tiny-grpo") / "run"
    result = run_harness(*TINY_GRPO_RUN, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir
