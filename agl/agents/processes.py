"""``runner.processes``: runner processes a job starts for itself, for agents that hold the GIL or
block (heavy Python tools, CrewAI) and would slow the job's own event loop, which serves the route.

Each is ``python harness.py algo=runner attach=<run dir> runner.n=<runner.per_process>``
(``agl.agents.attach``), started once the route is published, in the job's working directory and
environment (so the task's agent imports as in the job), writing to the job's output. One that
exits while the job runs is logged; when all have, ``on_all_exited`` gets the error that fails the
job. When the job stops, ``stop_watching`` comes first (their exits are expected from then on);
they stop on their own once the job withdraws its route, and ``wait`` waits for that and kills
what is left after ``grace_s``.

Left out: restarting a process that died. Its attempts go back to the queue uncharged (R7) and the
others carry on; a restart would hide an agent that crashes its process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

HARNESS = Path(__file__).resolve().parents[2] / "harness.py"


class RunnerProcessesExited(RuntimeError):
    """All of a job's runner processes exited while it ran."""


class RunnerProcesses:
    def __init__(self, n: int, run_dir: Path, runners_each: int, on_all_exited: Callable[[Exception], None]):
        self.n, self.run_dir, self.runners_each, self.on_all_exited = n, run_dir, runners_each, on_all_exited
        self.procs: list[asyncio.subprocess.Process] = []
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        for _ in range(self.n):
            self.procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(HARNESS),
                    "algo=runner",
                    f"attach={self.run_dir}",
                    f"runner.n={self.runners_each}",
                    start_new_session=True,  # a Ctrl-C is the job's to handle: it withdraws its entry and they leave
                )
            )
        self._watcher = asyncio.create_task(self._watch(), name="agl-runner-processes")

    async def _watch(self) -> None:
        waits = {asyncio.ensure_future(p.wait()): p for p in self.procs}
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                proc = waits[finished]
                log.warning(
                    "runner process %d exited with %s while the job ran; %d of %d left",
                    proc.pid,
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
                log.warning("runner process %d did not exit within %.0f s of the job's end: killed", proc.pid, grace_s)
                proc.kill()
                await proc.wait()
