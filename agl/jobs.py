"""Dispatch a composed config to the job its `algo.name` names."""
from __future__ import annotations

import resource

import psutil
from omegaconf import DictConfig

from agl.errors import ConfigError


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def info(cfg: DictConfig) -> dict:
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


JOBS = {"info": info}


def run_job(cfg: DictConfig) -> object:
    name = cfg.algo.name
    if name not in JOBS:
        raise ConfigError(f"algo '{name}' has no job; known: {', '.join(sorted(JOBS))}")
    return JOBS[name](cfg)
