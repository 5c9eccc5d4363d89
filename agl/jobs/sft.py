"""``algo=sft``: supervised fine-tuning of the LoRA on the task's demonstrations (agl.train.sft)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agl.config import Config
from agl.jobs.ending import job_ending
from agl.runtime import Runtime
from agl.train.sft import SFTTrainer


async def train_sft(config: Config, run_dir: Path) -> dict:
    async with Runtime.of(config, run_dir) as rt:
        return await SFTTrainer(rt, config.algo).train()


def run(config: Config, run_dir: Path) -> dict:
    result = asyncio.run(train_sft(config, run_dir))
    print(job_ending(run_dir, config, result["adapter"]))
    print(f"next:    python harness.py task={config.task.name} algo=grpo model.adapter={run_dir}    (GRPO from it)")
    return result
