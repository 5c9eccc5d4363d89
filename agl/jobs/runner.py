"""``algo=runner attach=<run dir>`` or ``algo=runner store.url=<url>``: this process joins a running job as a
runner process (agl.agents.attach)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agl.agents.attach import attach
from agl.config import Config, RunnerJobConfig


def run(config: Config, run_dir: Path) -> dict:
    algo: RunnerJobConfig = config.algo
    return asyncio.run(attach(config.attach, config.runner, config.store, route_url=algo.route_url))
