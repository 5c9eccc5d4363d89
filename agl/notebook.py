"""``agl.run("task=hello", "algo=grpo", "algo.steps=2")``: a harness run from Python, e.g. a notebook.

The same run as ``python harness.py task=hello algo=grpo algo.steps=2``: the config is composed
from the checkout's ``conf/`` with Hydra's compose API and the same overrides; the run dir is
``outputs/<date>/<time>_<task>_<algo>`` under the current directory, as harness.py's, or
``run_dir=``; the job is ``agl.jobs.dispatch.run_job``'s, so ``status.json``, ``error.log``, ``resume=``,
``report=`` and the skip of a succeeded run dir behave the same. The composed config is saved to
``<run dir>/.hydra/`` as Hydra saves it, so ``python harness.py resume=<run dir>`` works too.
Returns the job's result.

Inside a running event loop (a Jupyter kernel's) the job runs in a worker thread and this call
waits for it: every job starts its own loop with ``asyncio.run``, which a running loop forbids.

Left out: sweeps (``-m`` needs Hydra's launcher, which needs a command line: use harness.py) and
Hydra's logging setup (a notebook keeps its own logging).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from agl.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"


def run(*overrides: str, run_dir: str | Path | None = None) -> object:
    """Run ``python harness.py *overrides`` in this process; the job's result (see the module docstring)."""
    from agl.memory import cap_kernel_caches, release_freed_memory

    release_freed_memory()  # as harness.py does (late here: what a heap holds already stays there)
    cap_kernel_caches()  # as harness.py does (no effect if torch already ran a matmul)
    from agl.config.renamed import rename_overrides

    overrides, renamed = rename_overrides(overrides)  # keys renamed since (algo.loss_type -> algo.loss.type, ...)
    for line in renamed:
        logging.getLogger("agl").warning(line)
    cfg = compose_config(tuple(overrides))
    if not (cfg.get("resume") or cfg.get("report") or cfg.get("attach")):  # those name their own dir
        run_dir = Path(run_dir) if run_dir is not None else fresh_run_dir(cfg)
        save_config(cfg, overrides, run_dir)
        with open_dict(cfg):
            cfg.run_dir = str(run_dir)
    from agl.jobs.dispatch import run_job

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_job(cfg)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-run") as pool:
        return pool.submit(run_job, cfg).result()


def compose_config(overrides: tuple[str, ...]) -> DictConfig:
    if not (CONF / "config.yaml").is_file():
        raise ConfigError(f"agl.run composes the config from an agl checkout's conf/ directory, and {CONF} has none")
    from agl.config import compose_checked

    return compose_checked(str(CONF), list(overrides))  # registers the typed schemas; a typo is a ConfigError


def fresh_run_dir(cfg: DictConfig) -> Path:
    """harness.py's run dir (conf/config.yaml's hydra.run.dir); a suffix when that second's is taken."""
    base = Path("outputs") / time.strftime("%Y-%m-%d") / f"{time.strftime('%H-%M-%S')}_{cfg.task.name}_{cfg.algo.name}"
    path, n = base, 1
    while path.exists():  # two runs in one second must not share (and resume) one dir
        path, n = base.with_name(f"{base.name}-{n}"), n + 1
    return path


def save_config(cfg: DictConfig, overrides: tuple[str, ...], run_dir: Path) -> None:
    """What Hydra writes to ``.hydra/``: the composed config (``resume=`` reads it) and the overrides (sweeps read
    them)."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(overrides)), hydra_dir / "overrides.yaml")
