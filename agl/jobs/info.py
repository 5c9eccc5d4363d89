"""``algo=info``: load the policy and report its size and memory: the quickest check that the setup works."""

from __future__ import annotations

from pathlib import Path

import psutil

from agl.config import Config
from agl.memory import active_allocator, peak_rss_mib


def run(config: Config, run_dir: Path) -> dict:
    from agl.policy.load import load_policy

    policy = load_policy(config.model, config.device)
    trainable, total = policy.parameter_counts()
    report = {
        "model": policy.name,
        "device": str(policy.device),
        "quantization": config.model.quantization,
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
