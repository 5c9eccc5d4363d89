"""``algo=grpo``: GRPO on the task's agent (an SFT warm-up first when ``algo.warmup.steps`` > 0)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agl.config import Config
from agl.jobs.ending import job_ending
from agl.runtime import Runtime
from agl.train.grpo import check_update
from agl.train.grpo_trainer import GRPOTrainer


async def train(config: Config, run_dir: Path) -> dict:
    check_update(config.algo)  # a wrong loss or advantage is one line, before the model loads
    async with Runtime.of(config, run_dir) as rt:
        return await GRPOTrainer(rt, config.algo).train()


def run(config: Config, run_dir: Path) -> dict:
    result = asyncio.run(train(config, run_dir))
    print(job_ending(run_dir, config, result["adapter"]))
    return result
