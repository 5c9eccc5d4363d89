"""``algo=runner attach=<run dir>``: this process joins a running job as a runner process (agl.agents.attach)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agl.agents.attach import attach
from agl.config import Config


def run(config: Config, run_dir: Path) -> dict:
    return asyncio.run(attach(config.attach, config.runner))
