"""The one process: store, policy, engine, HTTP route and runners, started and stopped together.

    async with Runtime.of(config, run_dir) as rt:     # config: agl.config.Config (to_typed at the job's edge)
        rollouts = await rt.run_rollouts(tasks, mode="train", metadata=...)

Algorithms (GRPO, eval, prompt search) talk only to ``rt.store`` and ``rt.policy``; agents
talk only to the route. Data flows one way: task -> rollout -> spans -> samples -> update.

Runners need not live in this process: once the route serves, the runtime publishes what a
runner needs to join (``agl.agents.attach``; its own ``runner.n`` runners are made from the same entry),
starts ``runner.processes`` runner processes (where ``runner.launcher`` says: agl/agents/launch.py), and
withdraws the entry first when it stops. With ``runner.n=0`` only runner processes run the rollouts; with
none of either nothing would, which is a ConfigError rather than a wait.

The store need not live in this process either: with ``store.url`` it is a store served elsewhere
(``algo=store``), reached through ``agl.StoreClient``, and this process is one of its client sessions. A
client that loses the store (a request whose outcome is unknown, or its session ended for want of
heartbeats) fails the job, as a full disk does: nothing it would report could be trusted, and
``resume=`` continues exactly. Runner processes on other hosts (``runner.launcher=ray|slurm``) join by
the store's URL: a job without ``store.url`` serves its own store for them (``store.host``,
``store.port``, ``store.api_key``: agl/store/server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from agl.agents.attach import RUNNERS_KEY, runner_entry, runner_pool
from agl.agents.launch import JoinBy
from agl.agents.processes import RunnerProcesses
from agl.agents.runner import RunnerPool
from agl.agents.tasks import Task, load_task
from agl.config import (
    Config,
    EngineConfig,
    EvalCacheConfig,
    ModelConfig,
    RunnerConfig,
    ServerConfig,
    StoreConfig,
    TaskConfig,
    client_api_key,
    config_record,
    is_loopback,
    typed,
)
from agl.errors import ConfigError, DiskFull
from agl.memory import collect, long_lived_frozen
from agl.policy import compute_thread
from agl.policy.device import deterministic_kernels
from agl.policy.engine import Engine
from agl.policy.load import Policy, load_policy
from agl.route.server import ModelServer
from agl.store import SessionEnded, SqliteStore, StoreClient, StoreUnreachable
from agl.store.server import StoreServer
from agl.types import AttemptStatus, Rollout, RolloutConfig, RolloutStatus


class Runtime:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        task: TaskConfig,
        model: ModelConfig,
        runner: RunnerConfig | None = None,
        engine: EngineConfig | None = None,
        server: ServerConfig | None = None,
        store: StoreConfig | None = None,
        eval_cache: EvalCacheConfig | None = None,
        seed: int = 0,
        device: str = "auto",
        progress: bool = True,
        policy: Policy | None = None,
        record: dict | None = None,
    ):
        """Each part's typed section; ``record`` is the run's whole config as plain data, what jobs
        store as ``run_info['config']`` (``Runtime.of`` fills it)."""
        self.run_dir = Path(run_dir)
        self.task_config, self.model_config = typed(TaskConfig, task), typed(ModelConfig, model)
        self.runner_config = typed(RunnerConfig, runner or RunnerConfig())
        self.engine_config = typed(EngineConfig, engine or EngineConfig())
        self.server_config = typed(ServerConfig, server or ServerConfig())
        self.store_config = typed(StoreConfig, store or StoreConfig())
        self.eval_cache_config = typed(EvalCacheConfig, eval_cache or EvalCacheConfig())  # agl/eval/cache.py
        self.seed, self.device, self.progress, self.record = seed, device, progress, record
        runner = self.runner_config
        self.processes_n = runner.processes
        if self.processes_n and runner.per_process < 1:
            raise ConfigError(f"runner.per_process={runner.per_process}: each runner process needs at least one runner")
        if runner.n < 1 and self.processes_n < 1:
            raise ConfigError(
                "runner.n=0 and runner.processes=0: nothing would run the rollouts. Give this job runners "
                "(runner.n) or runner processes (runner.processes); "
                "algo=runner attach=<run dir> adds more to a running job"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.task: Task = load_task(self.task_config)
        self._policy = policy
        self.store: SqliteStore | StoreClient | None = None
        self.store_server: StoreServer | None = None  # this job's store served for runners on other hosts
        self.engine: Engine | None = None
        self.frozen_engine: Engine | None = None  # the base model, for server.frozen_models
        self.server: ModelServer | None = None
        self.runners: RunnerPool | None = None
        self.processes: RunnerProcesses | None = None
        self._published = False
        self._failure: Exception | None = None  # set by a part that fails the job from outside its task
        self._finished_uncollected = 0  # rollouts finished since the last agl.memory.collect
        self._settings = contextlib.ExitStack()  # process-wide settings for the runtime's life, given back after

    @classmethod
    def of(cls, config: Config, run_dir: str | Path, policy: Policy | None = None) -> Runtime:
        """The runtime of a job's typed config (``agl.config.to_typed``): its sections, spread."""
        return cls(
            run_dir,
            task=config.task,
            model=config.model,
            runner=config.runner,
            engine=config.engine,
            server=config.server,
            store=config.store,
            eval_cache=config.eval_cache,
            seed=config.seed,
            device=config.device,
            progress=config.progress,
            policy=policy,
            record=config_record(config),
        )

    async def record_config(self) -> None:
        """The run's config, into its store (``run_info['config']``: what report= shows)."""
        if self.record is not None:
            await self.store.set_run_info("config", self.record)

    @property
    def policy(self) -> Policy:
        assert self._policy is not None
        return self._policy

    async def __aenter__(self) -> Runtime:
        self._job_task = asyncio.current_task()  # what _fail cancels
        await self._open_store()
        if self._policy is None:
            self._policy = await compute_thread.run(load_policy, self.model_config, self.device)
        self._settings.enter_context(long_lived_frozen())  # the collections every few rollouts skip the model
        engine_options = engine_kwargs(self.engine_config, self.model_config.compute_dtype)
        if engine_options["batch_invariant"]:  # an exact run: on CUDA, deterministic kernels too (agl.policy.device)
            self._settings.enter_context(deterministic_kernels(self.policy.device))
        self.engine = Engine(self.policy, **engine_options)
        await self.engine.start()
        frozen_names = list(self.server_config.frozen_models or [])
        # one engine on the base weights serves every frozen name; its dense copy is built on first use
        if frozen_names:
            self.frozen_engine = Engine(self.policy, adapter=False, **engine_options)
            await self.frozen_engine.start()
        self.server = ModelServer(
            self.engine,
            self.policy,
            self.store,
            self.server_config,
            seed=self.seed,
            frozen={name: self.frozen_engine for name in frozen_names},
        )
        await self.server.start()
        entry = runner_entry(
            reachable(self.server.rollout_base_url("{rollout_id}", "{attempt_id}"), self.server_config.host),
            self.policy.name,
            client_api_key(self.server_config),
            self.store.session_id,
            self.task_config,
            self.default_sampling(),
        )
        self.runners = runner_pool(self.runner_config.n, self.store, entry, self.task.agent)
        await self.runners.__aenter__()
        await self.store.set_run_info(RUNNERS_KEY, entry)
        self._published = True
        if self.processes_n:
            runner = self.runner_config
            self.processes = RunnerProcesses(
                self.processes_n,
                self.join_by(),
                runner.per_process,
                self._fail,
                launcher=runner.launcher,
                launcher_args=runner.launcher_args,
                log_dir=self.run_dir,
            )
            await self.processes.start()
        return self

    async def _open_store(self) -> None:
        """This job's store: its run dir's ``store.sqlite`` (also served over HTTP when runner processes join
        by URL only), or, with ``store.url``, a client of a store served elsewhere."""
        settings = self.store_config
        if settings.url:
            self.store = StoreClient(
                settings.url, settings.api_key, on_broken=lambda why: self._fail(StoreUnreachable(why))
            )
            await self.store.open()
            return
        self.store = SqliteStore(self.run_dir / "store.sqlite")
        await self.store.__aenter__()  # opens, reaps a dead previous process's attempts, starts the watchdog
        if self.processes_n and self.runner_config.launcher != "local":
            self.store_server = StoreServer.of(self.store, settings)
            await self.store_server.start()

    def join_by(self) -> JoinBy:
        """How this job's runner processes join it: its run dir (local processes on its own store.sqlite), or
        its store's URL (a store served elsewhere, or the one this job serves for other hosts)."""
        if self.store_config.url:
            return JoinBy(store_url=self.store_config.url, api_key=self.store_config.api_key)
        if self.store_server is not None:
            return JoinBy(
                store_url=reachable(self.store_server.url, self.store_server.host), api_key=self.store_server.api_key
            )
        return JoinBy(run_dir=self.run_dir)

    def _fail(self, error: Exception) -> None:
        """Fail the job with ``error``: its task is cancelled, and leaving the runtime raises ``error``."""
        self._failure = error
        self._job_task.cancel()

    async def __aexit__(self, *exc: object) -> None:
        # The entry is withdrawn first: runner processes stop (their outcomes from then on are not
        # reported, and their attempts go back uncharged). Then in reverse order of start: no agent
        # calls the route, then no request reaches the engine; the store closes after the processes.
        if self.processes is not None:
            await self.processes.stop_watching()  # from here on their exits are expected
        if self._published:
            # a full disk (or a store lost: the job is failing for it) cannot take this write either; the route
            # stops below, which attached runners notice
            with contextlib.suppress(DiskFull, StoreUnreachable, SessionEnded):
                await self.store.set_run_info(RUNNERS_KEY, None)
        if self.runners is not None:
            await self.runners.__aexit__(None, None, None)
        for part in (self.server, self.engine, self.frozen_engine):
            if part is not None:
                await part.stop()
        if self.processes is not None:
            await self.processes.wait()
        if self.store_server is not None:
            await self.store_server.stop()
        if self.store is not None:
            await self.store.close()
        self._settings.close()
        if self._failure is not None:
            raise self._failure from None  # not "during handling of CancelledError"

    # ------------------------------------------------------------------ rollouts

    def default_sampling(self) -> dict:
        """Decoding settings for rollouts enqueued without their own ``metadata["sampling"]``."""
        return {}

    def rollout_config(self) -> RolloutConfig:
        r = self.runner_config
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
        finished: Sequence[str | None] | None = None,
        on_finished: Callable[[list[Rollout]], Awaitable[None]] | None = None,
    ) -> list[Rollout]:
        """Enqueue ``inputs`` (unless ``existing`` already holds them) and wait for all of them.

        ``existing`` is how a resumed step reuses the rollouts it had already enqueued: the
        finished ones are kept as they are, the rest were requeued by the store. ``finished``
        (one terminal status or None per input) records the inputs whose outcome is known (an
        eval cache's rows) instead of queuing them; ``on_finished`` is called with each batch of
        rollouts as they end (an eval keeps its rows as it goes: agl/eval/cache.py).
        """
        if existing:
            rollouts = list(existing)
        else:
            rollouts = await self.store.enqueue_rollouts(
                list(inputs),
                mode=mode,
                resources_id=resources_id,
                config=self.rollout_config(),
                metadata=list(metadata),
                finished=finished,
            )
        ids = [r.rollout_id for r in rollouts]
        done: dict[str, Rollout] = {}
        with tqdm(total=len(ids), desc=desc, leave=False, dynamic_ncols=True, disable=not self.progress) as bar:
            while len(done) < len(ids):
                ended = await self.store.wait_for_rollouts([i for i in ids if i not in done], timeout=1.0)
                for rollout in ended:
                    done[rollout.rollout_id] = rollout
                if ended and on_finished is not None:
                    await on_finished(ended)
                self._collect_after(len(ended))
                bar.update(len(ended))
        return [done[i] for i in ids]

    def _collect_after(self, finished: int) -> None:
        """Collect the agents' garbage every ``runner.collect_every`` finished rollouts (agl.memory.collect)."""
        every = self.runner_config.collect_every
        self._finished_uncollected += finished
        if every > 0 and self._finished_uncollected >= every:
            self._finished_uncollected = 0
            collect()

    async def resources_id(self, resources: dict) -> str:
        """Reuse the latest resources if they are the same, else add them as a new version."""
        latest = await self.store.get_latest_resources()
        if latest is not None and latest.resources == resources:
            return latest.resources_id
        return (await self.store.add_resources(resources)).resources_id


def reachable(url: str, host: str) -> str:
    """``url`` as another host reaches it: a server bound to every address (0.0.0.0, ::) is named by this
    machine's name instead."""
    if host in ("0.0.0.0", "::", "") and not is_loopback(host):
        bound = f"[{host}]" if ":" in host else host
        return url.replace(f"//{bound}:", f"//{socket.getfqdn()}:", 1)
    return url


def engine_kwargs(engine: EngineConfig, compute_dtype: str) -> dict:
    """``engine.*`` (EngineConfig) as Engine's keyword arguments."""
    return dict(
        max_batch_size=engine.max_batch_size,
        max_prefill_tokens=engine.max_prefill_tokens,
        weights=engine.weights,
        batch_invariant=batch_invariant(engine.batch_invariant, compute_dtype),
        decode=engine.decode,
        decode_4bit_rows=engine.decode_4bit_rows,
    )


def batch_invariant(setting: bool | str, compute_dtype: str) -> bool:
    """``engine.batch_invariant``: ``auto`` is on when ``model.compute_dtype`` is set to float32,
    asking for runs that repeat bit for bit (see agl.policy.engine), and off when ``auto`` merely fell
    back to float32 on a CPU without native bf16: that fallback should not also lose batching."""
    if setting == "auto":
        return compute_dtype == "float32"
    if not isinstance(setting, bool):
        raise ConfigError(f"engine.batch_invariant must be auto, true or false, not {setting!r}")
    return setting


def succeeded(rollouts: Sequence[Rollout]) -> list[Rollout]:
    return [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED]
