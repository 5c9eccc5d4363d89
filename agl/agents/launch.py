"""Where ``runner.processes`` start (``runner.launcher``): on this machine, on a Ray cluster, or through
submitit (SLURM, or its local executor). agl/agents/processes.py watches them; this module only starts,
waits for and kills them, on engines that are not agl's own.

  * ``local``: ``python harness.py algo=runner ...`` subprocesses (the run dir, or the store's URL).
  * ``ray``: one actor per runner process (``ray.init(address=...)``: ``runner.launcher_args.address``,
    else ``RAY_ADDRESS``, else a local cluster Ray starts; the other ``launcher_args`` are the actors'
    options, ``num_cpus`` 1 by default). Each runs ``agl.agents.attach.run_runner``: the runners join by the
    store's URL and leave when the job ends. Ray is an extra (``pip install -e '.[ray]'``).
  * ``slurm``, ``submitit_local``: one submitit job per runner process (``launcher_args``: submitit's
    parameters, e.g. ``slurm_partition``, ``timeout_min``, ``cpus_per_task``), running the same function.
    Its logs are in ``<run dir>/.submitit-runners/``.

Ray and SLURM workers run on other hosts: the task's agent must import there (the same checkout or package
on their ``PYTHONPATH``; for Ray, this process's working directory and ``PYTHONPATH`` are passed in its
``runtime_env`` unless ``launcher_args.runtime_env`` says otherwise).
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.agents.attach import run_runner
from agl.errors import ConfigError

LAUNCHERS = ("local", "ray", "slurm", "submitit_local")
HARNESS = Path(__file__).resolve().parents[2] / "harness.py"


@dataclass(frozen=True)
class JoinBy:
    """How a runner process finds the run: its run dir (this machine), or its store's URL (any host)."""

    run_dir: Path | None = None
    store_url: str | None = None
    api_key: str | None = None
    route_url: str | None = None  # the route as the runners reach it; None: the URL the job published

    def harness_args(self) -> list[str]:
        """``harness.py``'s arguments of a runner process that joins so."""
        if self.store_url is None:
            return [f"attach={self.run_dir}"]
        args = [f"store.url={self.store_url}"]
        if self.api_key:
            args.append(f"store.api_key={self.api_key}")
        if self.route_url:
            args.append(f"algo.route_url={self.route_url}")
        return args


def launcher_of(name: str, args: dict[str, Any], join: JoinBy, log_dir: Path | None = None) -> Any:
    if name == "local":
        return LocalLauncher(join)
    if name not in LAUNCHERS:
        raise ConfigError(f"runner.launcher={name}: no such launcher; known: {', '.join(LAUNCHERS)}")
    if join.store_url is None:
        raise ConfigError(
            f"runner.launcher={name} starts runner processes that join by the store's URL, and this job has none"
        )
    if name == "ray":
        return RayLauncher(args, join)
    return SubmititLauncher("slurm" if name == "slurm" else "local", args, join, log_dir)


def checkout_path() -> str:
    """This process's working directory, the checkout's root (tasks/) and its PYTHONPATH: where the task's agent
    imports from (agl.agents.tasks.import_object looks in the working directory too)."""
    parts = [os.getcwd(), str(HARNESS.parent), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


# ----------------------------------------------------------------------------- local


class LocalProcess:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.ident = proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    async def kill(self) -> None:
        self.proc.kill()
        await self.proc.wait()


class LocalLauncher:
    def __init__(self, join: JoinBy):
        self.join = join

    async def start(self, n: int, runners_each: int) -> list[LocalProcess]:
        args = [sys.executable, str(HARNESS), "algo=runner", *self.join.harness_args(), f"runner.n={runners_each}"]
        # start_new_session: a Ctrl-C is the job's to handle: it withdraws its entry and they leave
        return [LocalProcess(await asyncio.create_subprocess_exec(*args, start_new_session=True)) for _ in range(n)]

    async def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- Ray


class RunnerActor:
    """A runner process on a Ray cluster: one actor, its worker process's work ``run_runner``."""

    def run(self, url: str, api_key: str | None, n: int, route_url: str | None) -> dict:
        return run_runner(url, api_key, n, route_url)


class RayRunner:
    def __init__(self, ray: Any, actor: Any, ref: Any):
        self.ray, self.actor, self.ref = ray, actor, ref
        self.ident = f"ray actor {actor._actor_id.hex()[:12]}"
        self.returncode: int | str | None = None

    async def wait(self) -> int | str:
        if self.returncode is None:
            try:
                await self.ref
                self.returncode = 0
            except Exception as error:  # noqa: BLE001 (the actor's failure, told by its class)
                self.returncode = f"{type(error).__name__}"
        return self.returncode

    async def kill(self) -> None:
        self.ray.kill(self.actor)  # its store session's heartbeats stop: the store hands its attempts back
        await self.wait()


class RayLauncher:
    def __init__(self, args: dict[str, Any], join: JoinBy):
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "runner.launcher=ray needs Ray: pip install -e '.[ray]' (make test-ray builds .venv-ray)"
            ) from None
        self.ray, self.join = ray, join
        self.address = args.pop("address", None)
        runtime_env = args.pop("runtime_env", None)
        self.runtime_env = runtime_env if runtime_env is not None else {"env_vars": {"PYTHONPATH": checkout_path()}}
        self.options = {"num_cpus": 1, **args}
        self.started = False

    async def start(self, n: int, runners_each: int) -> list[RayRunner]:
        ray = self.ray
        if not ray.is_initialized():
            await asyncio.to_thread(ray.init, address=self.address, runtime_env=self.runtime_env)
            self.started = True
        actor_class = ray.remote(max_restarts=0, max_task_retries=0)(RunnerActor)
        runners = []
        for _ in range(n):
            actor = actor_class.options(**self.options).remote()
            ref = actor.run.remote(self.join.store_url, self.join.api_key, runners_each, self.join.route_url)
            runners.append(RayRunner(ray, actor, ref))
        return runners

    async def close(self) -> None:
        if self.started:
            await asyncio.to_thread(self.ray.shutdown)


# ----------------------------------------------------------------------------- submitit


class SubmititRunner:
    def __init__(self, job: Any):
        self.job = job
        self.ident = f"submitit job {job.job_id}"
        self.returncode: int | str | None = None

    async def wait(self) -> int | str:
        while self.returncode is None:
            if await asyncio.to_thread(self.job.done):
                error = await asyncio.to_thread(self.job.exception)
                self.returncode = 0 if error is None else type(error).__name__
                break
            await asyncio.sleep(0.5)
        return self.returncode

    async def kill(self) -> None:
        await asyncio.to_thread(self.job.cancel, check=False)
        await self.wait()


class SubmititLauncher:
    def __init__(self, cluster: str, args: dict[str, Any], join: JoinBy, log_dir: Path | None):
        import submitit  # the launchers extra (Hydra's submitit launcher brings it)

        folder = Path(log_dir or ".") / ".submitit-runners"
        self.executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
        self.executor.update_parameters(**{"timeout_min": 7 * 24 * 60, **args})  # a runner lives as long as the job
        self.join = join

    async def start(self, n: int, runners_each: int) -> list[SubmititRunner]:
        join = self.join
        jobs = [
            await asyncio.to_thread(
                self.executor.submit, run_runner, join.store_url, join.api_key, runners_each, join.route_url
            )
            for _ in range(n)
        ]
        return [SubmititRunner(job) for job in jobs]

    async def close(self) -> None:
        pass
