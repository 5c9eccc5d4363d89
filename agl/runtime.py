"""The one process: store, policy, engine, HTTP route and runners, started and stopped together.

    async with Runtime(cfg, run_dir) as rt:
        rollouts = await rt.run_rollouts(tasks, mode="train", metadata=...)

Algorithms (GRPO, eval, prompt search) talk only to ``rt.store`` and ``rt.policy``; agents
talk only to the route. Data flows one way: task -> rollout -> spans -> samples -> update.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig
from tqdm.auto import tqdm

from agl.engine import Engine
from agl.errors import ConfigError
from agl.model import Policy, load_policy
from agl.runner import RunnerPool
from agl.server import ModelServer
from agl.store import SqliteStore
from agl.tasks import Task, load_task
from agl.types import AttemptedRollout, AttemptStatus, Rollout, RolloutConfig, RolloutStatus


class Runtime:
    def __init__(self, cfg: DictConfig, run_dir: str | Path, policy: Policy | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.task: Task = load_task(cfg.task)
        self._policy = policy
        self.store: SqliteStore | None = None
        self.engine: Engine | None = None
        self.server: ModelServer | None = None
        self.runners: RunnerPool | None = None

    @property
    def policy(self) -> Policy:
        assert self._policy is not None
        return self._policy

    async def __aenter__(self) -> "Runtime":
        cfg = self.cfg
        self.store = SqliteStore(self.run_dir / "store.sqlite")
        await self.store.__aenter__()  # opens, reaps a dead previous process's attempts, starts the watchdog
        if self._policy is None:
            self._policy = await asyncio.to_thread(load_policy, cfg.model, cfg.device)
        self.engine = Engine(
            self.policy,
            max_batch_size=cfg.engine.max_batch_size,
            max_prefill_tokens=cfg.engine.max_prefill_tokens,
            weights=cfg.engine.get("weights", "merged"),  # runs saved before the option existed
            batch_invariant=batch_invariant(cfg.engine.get("batch_invariant", "auto"), cfg.model.compute_dtype),
        )
        await self.engine.start()
        self.server = ModelServer(self.engine, self.policy, self.store, host=cfg.server.host, port=cfg.server.port, api_key=cfg.server.api_key, seed=cfg.seed)
        await self.server.start()
        self.runners = RunnerPool(
            cfg.runner.n,
            store=self.store,
            agent=self.task.agent,
            llm_endpoint=self.server.rollout_base_url,
            model_name=self.policy.name,
            api_key=cfg.server.api_key or "agl",
            sampling_parameters=self.sampling_parameters,
        )
        await self.runners.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        # Stop in reverse order of start: no agent calls the route, then no request reaches the engine.
        if self.runners is not None:
            await self.runners.__aexit__(None, None, None)
        for part in (self.server, self.engine):
            if part is not None:
                await part.stop()
        if self.store is not None:
            await self.store.close()

    # ------------------------------------------------------------------ rollouts

    def sampling_parameters(self, rollout: AttemptedRollout) -> dict:
        """Decoding settings handed to the agent through ``llm.sampling_parameters``."""
        return (rollout.metadata or {}).get("sampling") or {}  # the Runner hands the agent a copy

    def rollout_config(self) -> RolloutConfig:
        r = self.cfg.runner
        return RolloutConfig(
            timeout_seconds=r.timeout_seconds,
            unresponsive_seconds=r.unresponsive_seconds,
            max_attempts=r.max_attempts,
            retry_condition=[AttemptStatus(s) for s in r.retry_condition],
        )

    async def run_rollouts(
        self,
        inputs: Sequence[Any],
        metadata: Sequence[dict],
        *,
        mode: str,
        resources_id: str | None,
        existing: Sequence[Rollout] = (),
        desc: str = "rollouts",
    ) -> list[Rollout]:
        """Enqueue ``inputs`` (unless ``existing`` already holds them) and wait for all of them.

        ``existing`` is how a resumed step reuses the rollouts it had already enqueued: the
        finished ones are kept as they are, the rest were requeued by the store.
        """
        if existing:
            rollouts = list(existing)
        else:
            rollouts = await self.store.enqueue_rollouts(
                list(inputs), mode=mode, resources_id=resources_id, config=self.rollout_config(), metadata=list(metadata)
            )
        ids = [r.rollout_id for r in rollouts]
        done: dict[str, Rollout] = {}
        with tqdm(total=len(ids), desc=desc, leave=False, dynamic_ncols=True, disable=not self.cfg.progress) as bar:
            while len(done) < len(ids):
                finished = await self.store.wait_for_rollouts([i for i in ids if i not in done], timeout=1.0)
                for rollout in finished:
                    done[rollout.rollout_id] = rollout
                bar.update(len(done) - bar.n)
        return [done[i] for i in ids]

    async def resources_id(self, resources: dict) -> str:
        """Reuse the latest resources if they are the same, else add them as a new version."""
        latest = await self.store.get_latest_resources()
        if latest is not None and latest.resources == resources:
            return latest.resources_id
        return (await self.store.add_resources(resources)).resources_id


def batch_invariant(setting: bool | str, compute_dtype: str) -> bool:
    """``engine.batch_invariant``: ``auto`` is on when ``model.compute_dtype`` is set to float32,
    asking for runs that repeat bit for bit (see agl.engine), and off when ``auto`` merely fell
    back to float32 on a CPU without native bf16: that fallback should not also lose batching."""
    if setting == "auto":
        return compute_dtype == "float32"
    if not isinstance(setting, bool):
        raise ConfigError(f"engine.batch_invariant must be auto, true or false, not {setting!r}")
    return setting


def succeeded(rollouts: Sequence[Rollout]) -> list[Rollout]:
    return [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
