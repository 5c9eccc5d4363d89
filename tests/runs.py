"""The reference run, shared by the exactness, runner-process, logger and report tests, and how tests start
``harness.py`` as users do.

One fp32 job on the tiny model (so the engine is batch-invariant): a multi-turn agent through the real
route, 8 concurrent runners, 1 SFT warm-up step then 2 GRPO steps (every kill point of
tests/crash_points.py is crossed, and the switch from SFT to GRPO), evals before, after the warm-up,
every 2 steps and at the end. Every fourth task is never solved (its group's rewards are equal), and dynamic
sampling draws more: step 1's first 2 tasks leave 1 informative group, a second round of 2 gives 2 more (3, and
the step trains on the first 2); step 2's first 2 are both never solved, and the bound (2 extra) stops it at 1.
``runner.max_attempts=1``: a harness death charged to the agent would fail its rollout. The same config and seed
must end byte-identical however it is run: again, killed and resumed, with runner processes, with loggers.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from prefork import Forked, forkable

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "model=tiny",
    "algo=grpo",
    "progress=false",
    "runner.max_attempts=1",
    "task=hello",
    "seed=3",
    "task.agent=crash_points:multi_turn_agent",
    "task.data=crash_points:load",
    "task.max_tokens=6",
    "+task.resources.max_turns=2",
    "+task.resources.never_solved_every=4",
    "task.eval_size=4",
    "task.final_eval_size=6",  # the baseline and final evals: 6 tasks (eval_all/), the periodic ones the first 4
    "algo.steps=2",
    "algo.dynamic_sampling=true",
    "algo.max_extra_groups=2",
    "algo.eval_every=2",
    "algo.batch_size=2",
    "algo.group_size=4",
    "algo.micro_batch_size=4",
    "algo.lr=1e-2",
    "algo.warmup.steps=1",
    "algo.warmup.batch_size=4",
    "algo.warmup.micro_batch_size=2",
    "algo.warmup.lr=1e-2",
]
IN_PROCESS_RUNNERS = ["runner.n=8"]
STEPS = 3  # 1 SFT + 2 GRPO
GROUPS_PER_STEP = 4  # batch_size, and the 2 extra tasks dynamic sampling drew in each step
ROLLOUTS_PER_STEP = GROUPS_PER_STEP * 4  # x group_size


def is_cost(name: str) -> bool:
    """What a process measures about itself, not what the run computed: wall times (time_*, *_s,
    tokens_per_s), memory (*_mib) and the engine's prefill counter (shared prefills depend on arrival
    order, and a resumed step reuses finished rollouts)."""
    return name.startswith("time_") or name.endswith(("_s", "_mib")) or name == "prompt_tokens"


# the harness processes' output files, removed when this (test) process exits
LOGS = Path(tempfile.mkdtemp(prefix="agl-harness-logs-"))
atexit.register(shutil.rmtree, LOGS, ignore_errors=True)


class Output:
    """A harness whose output (stdout and stderr, its runner processes' too) goes to a file, ``log``, never to
    a pipe: a test that waits on something else would not read the pipe, and a full pipe stops every process
    writing to it (a loaded machine makes more warnings: the wait would be forever)."""

    log: IO[str]  # a NamedTemporaryFile's

    def _open_log(self) -> str:
        self.log = tempfile.NamedTemporaryFile("w+", dir=LOGS, suffix=".log", delete=False)
        return self.log.name

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str, None]:  # noqa: A002 (Popen's name)
        self.wait(timeout=timeout)
        return self.output(), None


class Harness(Output, subprocess.Popen):
    """``python harness.py`` in a fresh interpreter (what tests/prefork.py cannot fork)."""

    def __init__(self, args: list[str], env: dict):
        self._open_log()
        command = [sys.executable, "harness.py", *args]
        super().__init__(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)


class ForkedHarness(Output, Forked):
    """``python harness.py`` forked from this test process's forkserver (tests/prefork.py)."""

    def __init__(self, args: list[str], env: dict):
        log = self._open_log()
        super().__init__(args, env, stdout=log, stderr=log)


def harness(
    *args: str,
    kill: str = "",
    device: str = "cpu",
    eval_cache: Path | None = None,
    env: dict | None = None,
    fresh: bool = False,
) -> Harness | ForkedHarness:
    """``python harness.py *args`` in its own process group, on ``device`` (a resumed run keeps the device it
    was started with: its saved config), forked where it can be (tests/prefork.py) unless ``fresh``. ``kill``:
    a tests/crash_points.py kill point; ``eval_cache``: the eval cache's dir (else the session's,
    tests/conftest.py)."""
    if not any(a.startswith("resume=") for a in args):
        args = (*args, f"device={device}")
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "tests"), "AGL_TEST_KILL": kill}
    environ.pop("HYDRA_FULL_ERROR", None)
    if eval_cache is not None:
        environ["AGL_EVAL_CACHE"] = str(eval_cache)
    environ.update(env or {})
    return (ForkedHarness if forkable(args, environ) and not fresh else Harness)(list(args), environ)


def finish(proc: Output, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def job_started(proc: Output, run_dir: Path, timeout: float = 300) -> None:
    """Wait until ``proc``'s job has begun in ``run_dir`` (its status.json names it running: agl/report/status.py)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):  # not written yet
            status = json.loads((run_dir / "status.json").read_text())
            if status["status"] == "running" and status["pid"] == proc.pid:
                return
        time.sleep(0.05)
    raise AssertionError(f"its job did not start in {run_dir}: " + proc.output()[-2000:])


def run(run_dir: Path, *extra: str, device: str = "cpu", eval_cache: Path | None = None, fresh: bool = False) -> Path:
    """The reference job (``RUN`` with in-process runners, then ``extra``) into ``run_dir``."""
    args = (*RUN, *IN_PROCESS_RUNNERS, *extra, f"hydra.run.dir={run_dir}")
    finish(harness(*args, device=device, eval_cache=eval_cache, fresh=fresh))
    return run_dir


def as_saved_before_the_renames(run_dir: Path) -> None:
    """Rewrite ``run_dir``'s saved config as runs saved it before the loss and advantage registries and the layout
    change: ``algo``'s flat loss keys at the defaults of the time (``loss_type: dapo``, ``epsilon``, ...,
    ``scale_rewards: group``), and ``agl.sweep.SweepSummary`` (a module gone since) as Hydra's callback."""
    import yaml

    config_file, hydra_file = run_dir / ".hydra" / "config.yaml", run_dir / ".hydra" / "hydra.yaml"
    config = yaml.safe_load(config_file.read_text())
    algo = config["algo"]
    assert algo.pop("loss") == {"type": "dapo"} and algo.pop("advantage") == "grpo"
    algo.update(loss_type="dapo", scale_rewards="group", epsilon=0.2, epsilon_high=0.28)
    algo.update(opmd_tau=1.0, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    hydra = hydra_file.read_text()
    assert "agl.report.sweep.SweepSummary" in hydra
    hydra_file.write_text(hydra.replace("agl.report.sweep.SweepSummary", "agl.sweep.SweepSummary"))


def adapter(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's rows without what a process measures about itself (``is_cost``)."""
    return [{k: v for k, v in row.items() if not is_cost(k)} for row in all_metrics(run_dir)]


def all_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def query(run_dir: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(run_dir / "store.sqlite", timeout=30) as conn:
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError:  # not created yet
            return []
