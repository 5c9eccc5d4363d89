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


def pytest_collection_modifyitems(items):
    """A test that reads the reference run is of its family (marker ``exact``): ``make test`` runs them
    together, after the others, in one process (the run is made once) on a machine no other test loads."""
    for item in items:
        if "reference" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.exact)


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> Path:
    """The reference run (tests/runs.py): one harness job whose bytes every exactness test compares with,
    and whose run dir the report and eval tests read. Read-only."""
    from runs import run

    return run(tmp_path_factory.mktemp("reference") / "run")


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
