"""``runner.processes``: runner processes a job starts for itself, for agents that hold the GIL or
block (heavy Python tools, CrewAI) and would slow the job's own event loop, which serves the route;
and, with ``runner.launcher``, runner processes on other machines.

Each runs ``runner.per_process`` runners (``agl.agents.attach``), started once the route is published.
Where (``runner.launcher``; agl/agents/launch.py starts them):

  * ``local`` (the default): ``python harness.py algo=runner attach=<run dir>`` (or ``store.url=<url>``,
    for a job on a store served elsewhere), in the job's working directory and environment (so the
    task's agent imports as in the job), writing to the job's output;
  * ``ray``: actors on a Ray cluster; ``slurm``, ``submitit_local``: jobs of submitit's executors. These
    join by the store's URL only (the job's ``store.url``, or the store the job serves itself).

One that exits while the job runs is logged; when all have, ``on_all_exited`` gets the error that
fails the job. When the job stops, ``stop_watching`` comes first (their exits are expected from then
on); they stop on their own once the job withdraws its route, and ``wait`` waits for that and kills
what is left after ``grace_s``.

Left out: restarting a process that died. Its attempts go back to the queue uncharged (R7) and the
others carry on; a restart would hide an agent that crashes its process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agl.agents.launch import JoinBy, launcher_of

log = logging.getLogger(__name__)


class RunnerProcessesExited(RuntimeError):
    """All of a job's runner processes exited while it ran."""


class RunnerProcesses:
    """``n`` runner processes of ``runners_each`` runners, started by ``launcher`` (see the module docstring)."""

    def __init__(
        self,
        n: int,
        join: JoinBy,
        runners_each: int,
        on_all_exited: Callable[[Exception], None],
        launcher: str = "local",
        launcher_args: dict[str, Any] | None = None,
        log_dir: Path | None = None,
    ):
        self.n, self.join, self.runners_each, self.on_all_exited = n, join, runners_each, on_all_exited
        self.launcher = launcher_of(launcher, dict(launcher_args or {}), join, log_dir)  # Ray, submitit: imported then
        self.procs: list[Any] = []  # the launcher's handles: .ident, .wait(), .kill(), .returncode
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        self.procs = await self.launcher.start(self.n, self.runners_each)
        self._watcher = asyncio.create_task(self._watch(), name="agl-runner-processes")

    async def _watch(self) -> None:
        waits = {asyncio.ensure_future(p.wait()): p for p in self.procs}
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                proc = waits[finished]
                log.warning(
                    "runner process %s exited with %s while the job ran; %d of %d left",
                    proc.ident,
                    proc.returncode,
                    len(pending),
                    self.n,
                )
        codes = ", ".join(str(p.returncode) for p in self.procs)
        self.on_all_exited(
            RunnerProcessesExited(
                f"all {self.n} runner processes (runner.processes) exited while the job ran, with exit codes {codes}: "
                "see their output above"
            )
        )

    async def stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    async def wait(self, grace_s: float = 30.0) -> None:
        """Wait until they have exited (they do once the route is withdrawn); kill the rest after ``grace_s``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.procs)), grace_s)
        for proc in self.procs:
            if proc.returncode is None:
                log.warning(
                    "runner process %s did not exit within %.0f s of the job's end: killed", proc.ident, grace_s
                )
                await proc.kill()
        await self.launcher.close()
