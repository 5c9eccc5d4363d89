"""Dispatch a composed config to the job its `algo.name` names.

``run_job`` also owns what every job shares: ``report=`` (no model, dispatched first),
``resume=``, and the run dir's ``status.json`` (running / succeeded / failed). A run dir
whose status is ``succeeded`` is skipped; any other existing run dir is resumed from its
store. In a sweep (Hydra multirun) a failing job is recorded as failed, its traceback
written to ``error.log``, and the sweep goes on.
"""
from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import logging
import os
import time
import traceback
from pathlib import Path

import psutil
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from agl.config import with_schema
from agl.errors import ConfigError
from agl.launchers import apply_threads
from agl.loggers import run_loggers
from agl.memory import active_allocator, peak_rss_mib
from agl.seeding import seed_everything
from agl.sweep import read_status, write_status

log = logging.getLogger(__name__)


def info(cfg: DictConfig, run_dir: Path) -> dict:
    """Load the policy and report its size: the quickest check that the setup works."""
    from agl.model import load_policy

    policy = load_policy(cfg.model, cfg.device)
    trainable, total = policy.parameter_counts()
    report = {
        "model": policy.name,
        "device": str(policy.device),
        "quantization": cfg.model.quantization,
        "trainable_params": trainable,
        "total_params": total,
        "trainable_pct": round(100 * trainable / total, 3),
        "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "malloc": active_allocator(),
    }
    for key, value in report.items():
        print(f"{key:>17}: {value}")
    return report


def grpo(cfg: DictConfig, run_dir: Path) -> dict:
    from agl.trainer import train

    result = asyncio.run(train(cfg, run_dir))
    print(f"run dir: {run_dir}\nadapter: {result['adapter']}\nresume:  python harness.py resume={run_dir}")
    return result


def eval_job(cfg: DictConfig, run_dir: Path) -> dict:
    from agl.eval_job import run_eval

    return asyncio.run(run_eval(cfg, run_dir))


def prompt_search(cfg: DictConfig, run_dir: Path) -> dict:
    from agl.prompt_search import run_prompt_search

    return asyncio.run(run_prompt_search(cfg, run_dir))


def sft(cfg: DictConfig, run_dir: Path) -> dict:
    from agl.sft import train_sft

    result = asyncio.run(train_sft(cfg, run_dir))
    print(f"run dir: {run_dir}\nadapter: {result['adapter']}\nnext:    python harness.py algo=grpo model.adapter={run_dir} ...")
    return result


def custom(cfg: DictConfig, run_dir: Path) -> object:
    from agl.custom_algo import run_custom

    return asyncio.run(run_custom(cfg, run_dir))


def serve(cfg: DictConfig, run_dir: Path) -> dict:
    from agl.serve_job import run_serve

    return asyncio.run(run_serve(cfg, run_dir))


def export(cfg: DictConfig, run_dir: Path) -> dict:
    from agl.export import run_export

    return run_export(cfg, run_dir)


def runner(cfg: DictConfig, run_dir: Path) -> dict:
    """``algo=runner attach=<run dir>``: a runner process joining another job's run."""
    from agl.attach import attach

    return asyncio.run(attach(cfg))


JOBS = {
    "info": info, "grpo": grpo, "eval": eval_job, "prompt_search": prompt_search, "sft": sft, "custom": custom,
    "serve": serve, "export": export, "runner": runner,
}


def resumed_config(cfg: DictConfig) -> DictConfig:
    """The config a run was started with, read back from its run dir."""
    run_dir = Path(cfg.resume)
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume='{cfg.resume}' is not a run dir (no {saved})")
    original = with_schema(OmegaConf.load(saved))  # keys added since the run started take their defaults
    original.resume = str(run_dir)
    return original


QUIET_LOGGERS = ("httpx", "httpx2", "httpcore", "openai")


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def config_hash(cfg: DictConfig) -> str:
    plain = OmegaConf.to_container(cfg, resolve=True)
    for key in ("resume", "report", "progress", "device", "run_dir", "threads", "logger"):  # run_dir: agl.run's, where Hydra's is not in cfg
        plain.pop(key, None)
    return hashlib.sha1(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_job(cfg: DictConfig) -> object:
    for name in QUIET_LOGGERS:  # one line per agent HTTP call would drown the progress bars
        logging.getLogger(name).setLevel(logging.WARNING)
    if cfg.get("report"):  # reads files only: no model, no status
        from agl.report import report

        return report(cfg.report)
    multirun = in_multirun()
    if cfg.get("resume"):
        cfg = resumed_config(cfg)
        run_dir = Path(cfg.resume)
    else:
        run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.get("run_dir") or cfg.get("attach") or ".")
    name = cfg.algo.name
    if name not in JOBS:
        raise ConfigError(f"algo '{name}' has no job; known: {', '.join(sorted(JOBS))}")
    if cfg.get("attach") and name != "runner":
        raise ConfigError(f"attach= joins a running job as a runner process: use it with algo=runner, not algo={name}")
    threads = apply_threads(cfg, HydraConfig.get() if multirun else None)  # jobs x threads <= cores (agl/launchers.py)
    if name in ("info", "runner"):  # a smoke test; a process working in another job's run: nothing of their own to record or resume
        return JOBS[name](cfg, run_dir)

    previous = read_status(run_dir)
    digest = config_hash(cfg)
    if previous and previous.get("config_hash") not in (None, digest):
        log.warning("%s was started with a different config (changed conf/ files?); continuing with the new one", run_dir)
    if previous and previous.get("status") == "succeeded":
        print(f"skip: {run_dir} already finished (its {run_dir / 'status.json'} says succeeded; delete it to run again)")
        return previous.get("result")
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    if previous:
        print(f"continuing {run_dir} (status was {previous.get('status')}) from its store")
    started = time.time()
    write_status(
        run_dir, "running", algo=name, task=cfg.task.name, pid=os.getpid(), host=os.uname().nodename, started=started,
        ended=None, duration_s=None, error=None, config_hash=digest, threads=threads, **({"overrides": overrides} if overrides and not cfg.get("resume") else {}),
    )
    try:
        seed_everything(cfg.seed)  # before the model is built: the LoRA's initial weights repeat
        with run_loggers(cfg, run_dir):  # logger=: metrics.jsonl's rows also to tensorboard / wandb
            result = JOBS[name](cfg, run_dir)
    except (Exception, SystemExit) as error:
        trace = traceback.format_exc()
        (run_dir / "error.log").write_text(trace)
        message = f"{type(error).__name__}: {error}"
        write_status(run_dir, "failed", error=message, ended=time.time(), duration_s=time.time() - started)
        if not multirun:
            raise
        log.error("job failed, the sweep goes on: %s (traceback in %s)", message, run_dir / "error.log")
        return None
    finally:
        if multirun:
            gc.collect()  # the next job loads its own policy
    write_status(run_dir, "succeeded", result=result, ended=time.time(), duration_s=time.time() - started)
    return result
