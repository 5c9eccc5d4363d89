"""Fixtures shared by test modules."""

import os

# the suite runs its lanes and workers side by side on two cores: OpenMP workers spinning in one process would take
# the cores from the others (a job alone spins: agl/policy/compute_thread.py). Set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # see harness.py: before cuBLAS starts (CUDA only)
import atexit
import shutil
import tempfile
from pathlib import Path

import pytest
import pytest_asyncio
from filelock import FileLock
from omegaconf import OmegaConf
from store_helpers import FakeClock, client_of

from agl.config import register_configs
from agl.store import SqliteStore

# The eval cache (agl/eval/cache.py) of every test and of every harness a test starts: a directory of this
# session's, never the user's. Tests that need their own set AGL_EVAL_CACHE or eval_cache.dir themselves.
os.environ["AGL_EVAL_CACHE"] = tempfile.mkdtemp(prefix="agl-test-evals-")
atexit.register(shutil.rmtree, os.environ["AGL_EVAL_CACHE"], ignore_errors=True)

# tests/test_ray.py is the Ray lane's (make test-ray, in .venv-ray: Ray is an extra the main venv does not carry)
collect_ignore = [] if os.environ.get("AGL_LANE") == "ray" else ["test_ray.py"]

register_configs()  # conf/ names the typed schemas (agl/config/schema.py): tests compose it with Hydra's compose API

# The tiny random-weight Llama with the real SmolLM2 tokenizer (conf/model/tiny.yaml, resolved:
# that file uses Hydra defaults, so it cannot be loaded on its own). AGL_TOKENIZER: where the tokenizer's
# files are instead of the embedded GGUF (bench/gpu_check.sh sets it on a GPU node).
TINY_MODEL = {
    "name": "tiny",
    "path": "tiny",
    "cache_dir": os.environ.get("AGL_CACHE", "~/.cache/agl"),  # as conf/model/smollm2.yaml reads them
    "tokenizer": os.environ.get("AGL_TOKENIZER"),  # a GPU node has no embedded GGUF: its tokenizer's files
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


# The CUDA lane: tests that take ``device`` run once per device, on "cuda" wherever torch sees a GPU
# (``pytest -m cuda`` runs only those); without one the cuda runs skip, saying so, and the cpu runs are
# the suite as it was. docs/gpu.md.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
NO_CUDA = "torch sees no CUDA device (the CUDA lane runs where one is: bench/gpu_check.sh)"


def skip_without(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    """The device a test's policy and tensors live on: "cpu", then "cuda" (skipped without a GPU)."""
    skip_without(request.param)
    return request.param


def pytest_collection_modifyitems(items):
    """A test that reads the reference run is of its family (marker ``exact``: ``pytest -m exact`` runs it
    alone)."""
    for item in items:
        if "reference" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.exact)


def made_once(tmp_path_factory, name: str, make) -> Path:
    """``<dir>/<name>``, made by ``make(dir)`` once per test session: under pytest-xdist, by the first worker
    that asks while the others wait on a lock, then read by all (the pattern pytest-xdist documents). The
    directory holds what ``make`` writes (a run, and the reference's eval cache); ``done`` marks it whole."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the workers' basetemps are popen-gw0, popen-gw1, ... in the session's
    shared = base / name
    with FileLock(f"{shared}.lock"):
        if not (shared / "done").is_file():
            shutil.rmtree(shared, ignore_errors=True)
            shared.mkdir()
            make(shared)
            (shared / "done").touch()
    return shared


@pytest.fixture(scope="session")
def reference(tmp_path_factory, device) -> Path:
    """The reference run (tests/runs.py) on each device (on CUDA: float32 with torch's deterministic
    algorithms): one harness job whose bytes every exactness test compares with, and whose run dir the report
    and eval tests read. Read-only. Its evals fill its own eval cache, ``<run dir>/../evals`` (the same run with
    a copy of that cache replays every eval: tests/test_reproducible.py)."""
    from runs import run

    shared = made_once(
        tmp_path_factory, f"reference-{device}", lambda d: run(d / "run", device=device, eval_cache=d / "evals")
    )
    return shared / "run"


@pytest.fixture(scope="session")
def tiny_model_cfg():
    """The `model` config of the tiny policy: `load_policy(tiny_model_cfg, "cpu")`. Read-only."""
    return OmegaConf.create(TINY_MODEL)


# The store tests': a fake clock, a store file in tmp_path, and a store on both: the store's behaviour suite
# runs on the local store and on a client of it served over HTTP (agl/store/server.py, in this process:
# tests/store_helpers.client_of), so every test taking `store` runs on both.
@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "run" / "store.sqlite"


@pytest.fixture(params=["local", "client"])
def store_kind(request) -> str:
    return request.param


@pytest_asyncio.fixture
async def local_store(path: Path, clock: FakeClock):
    """The store itself, for a test of how it reads its file (query plans), not of its API."""
    s = SqliteStore(path, clock=clock, watchdog_interval=None)
    yield s
    await s.close()


@pytest_asyncio.fixture
async def store(path: Path, clock: FakeClock, store_kind: str):
    local = SqliteStore(path, clock=clock, watchdog_interval=None)
    if store_kind == "local":
        yield local
    else:
        client = client_of(local)
        yield client
        await client.close()
    await local.close()


# A small finished GRPO run (harness.py in a process of its own, forked: tests/prefork.py): a multi-turn agent
# through the route, a checkpoint per step. Read-only for its users: a test that damages or extends it works on a
# copy (shutil.copytree).
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
    """``python harness.py *args`` from the checkout, tests/ importable (the agents above live there), forked
    where it can be (tests/prefork.py): a ``subprocess.CompletedProcess``."""
    from prefork import run

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(root / "tests")}
    return run(list(args), env, timeout)


@pytest.fixture(scope="session")
def tiny_grpo_run(tmp_path_factory) -> Path:
    def make(shared: Path) -> None:
        result = run_harness(*TINY_GRPO_RUN, f"hydra.run.dir={shared / 'run'}")
        assert result.returncode == 0, result.stderr[-3000:]

    return made_once(tmp_path_factory, "tiny-grpo", make) / "run"
