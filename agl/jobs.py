"""Dispatch a composed config to the job its `algo.name` names."""
from __future__ import annotations

import asyncio
import logging
import resource
from pathlib import Path

import psutil
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from agl.errors import ConfigError

log = logging.getLogger(__name__)


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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
    }
    for key, value in report.items():
        print(f"{key:>17}: {value}")
    return report


def grpo(cfg: DictConfig, run_dir: Path) -> dict:
    from agl.trainer import train

    result = asyncio.run(train(cfg, run_dir))
    print(f"run dir: {run_dir}\nadapter: {result['adapter']}\nresume:  python harness.py resume={run_dir}")
    return result


JOBS = {"info": info, "grpo": grpo}


def resumed_config(cfg: DictConfig) -> DictConfig:
    """The config a run was started with, read back from its run dir."""
    run_dir = Path(cfg.resume)
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume='{cfg.resume}' is not a run dir (no {saved})")
    original = OmegaConf.load(saved)
    original.resume = str(run_dir)
    return original


QUIET_LOGGERS = ("httpx", "httpx2", "httpcore", "openai")
# bitsandbytes warns that an optional kernel hub package is missing; agl never uses that kernel
# (see agl.model.keep_4bit_matmul_differentiable).
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def run_job(cfg: DictConfig) -> object:
    for name in QUIET_LOGGERS:  # one line per agent HTTP call would drown the progress bars
        logging.getLogger(name).setLevel(logging.WARNING)
    if cfg.get("resume"):
        cfg = resumed_config(cfg)
        run_dir = Path(cfg.resume)
    else:
        run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.run_dir)
    name = cfg.algo.name
    if name not in JOBS:
        raise ConfigError(f"algo '{name}' has no job; known: {', '.join(sorted(JOBS))}")
    return JOBS[name](cfg, run_dir)
