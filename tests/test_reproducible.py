"""One seed gives one run, and kill -9 changes nothing (README "Resume").

With runner.max_attempts=1 a harness death charged to the agent would fail its rollout.

Real harness subprocesses on the tiny model (float32, so the engine is batch-invariant), a
multi-turn agent through the real route, 8 concurrent runners: the same config and seed must
end with byte-identical adapters and metrics, with or without kills at random moments, inside
the update and inside a checkpoint write.
"""

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "model=tiny",
    "algo=grpo",
    "progress=false",
    "runner.n=8",
    "runner.max_attempts=1",
    "task=hello",
    "seed=3",
    "task.agent=crash_points:multi_turn_agent",
    "task.data=crash_points:load",
    "task.max_tokens=6",
    "+task.resources.max_turns=2",
    "task.eval_size=4",
    "algo.steps=5",
    "algo.eval_every=2",
    "algo.batch_size=2",
    "algo.group_size=4",
    "algo.micro_batch_size=4",
    "algo.lr=1e-2",
    # an SFT warm-up first (steps 0-1): kills may land in it or at the switch to GRPO
    "algo.warmup.steps=2",
    "algo.warmup.batch_size=4",
    "algo.warmup.micro_batch_size=2",
    "algo.warmup.lr=1e-2",
]


# What a process measures about itself, not what the run computed: wall times (time_*, *_s,
# tokens_per_s) and the engine's prefill counter (shared prefills depend on arrival order, and a
# resumed step reuses finished rollouts).
def is_cost(name: str) -> bool:
    return name.startswith("time_") or name.endswith(("_s", "_mib")) or name == "prompt_tokens"


def harness(*args: str, kill: str = "", device: str = "cpu", eval_cache: Path | None = None) -> subprocess.Popen:
    """``harness.py`` on ``device`` (a resumed run keeps the device it was started with: its saved config)."""
    if not any(a.startswith("resume=") for a in args):
        args = (*args, f"device={device}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "tests"), "AGL_TEST_KILL": kill}
    if eval_cache is not None:  # else the session's (tests/conftest.py), which the reference run fills
        env["AGL_EVAL_CACHE"] = str(eval_cache)
    return subprocess.Popen(
        [sys.executable, "harness.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> None:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]


def run(run_dir: Path, device: str) -> Path:
    finish(harness(*RUN, f"hydra.run.dir={run_dir}", device=device))
    return run_dir


def adapter(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not is_cost(k)} for row in rows]


def query(run_dir: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(run_dir / "store.sqlite", timeout=30) as conn:
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError:  # not created yet
            return []


@pytest.fixture(scope="module")
def reference(tmp_path_factory, device) -> Path:
    """The uninterrupted run, on each device (on CUDA: float32 with torch's deterministic algorithms)."""
    return run(tmp_path_factory.mktemp("reference") / "run", device)


SPANS = (
    "SELECT rollout_id, attempt_id, sequence_id, name, prompt_token_ids, response_token_ids, response_logprobs "
    "FROM spans ORDER BY rollout_id, sequence_id"
)


def test_one_seed_gives_one_run(reference, tmp_path, device):
    again = tmp_path / "again"
    finish(harness(*RUN, f"hydra.run.dir={again}", device=device, eval_cache=tmp_path / "evals"))  # an empty cache
    assert adapter(again) == adapter(reference)
    assert metrics(again) == metrics(reference)
    # the store too: the same rollouts, ids, tokens and log-probs (stored in arrival order, so sorted)
    assert query(again, SPANS) == query(reference, SPANS)


def test_evals_replayed_from_the_cache_change_nothing(reference, tmp_path):
    """The reference run filled the session's eval cache: the same run again replays every eval from it (the
    same adapters give the same keys), and trains the same adapter through the same rollouts, ids and tokens."""
    again = run(tmp_path / "again")
    assert adapter(again) == adapter(reference)
    assert metrics(again) == metrics(reference)
    cached = "SELECT rollout_id FROM rollouts WHERE json_extract(metadata, '$.cached') IS NOT NULL ORDER BY seq"
    evals = "SELECT rollout_id FROM rollouts WHERE json_extract(metadata, '$.eval_step') IS NOT NULL ORDER BY seq"
    replayed = {rid for (rid,) in query(again, cached)}
    assert replayed and query(again, cached) == query(reference, evals)
    assert query(again, SPANS) == [row for row in query(reference, SPANS) if row[0] not in replayed]


def test_another_seed_gives_another_run(reference, tmp_path, device):
    other = tmp_path / "other"
    finish(harness(*RUN, "seed=4", f"hydra.run.dir={other}", device=device))
    assert adapter(other) != adapter(reference)


def test_kill_9_anywhere_changes_nothing(reference, tmp_path, device):
    """Killed at three random moments, then inside a rollout, inside an update and inside a
    checkpoint write, resumed each time: the adapter bytes and metrics of the uninterrupted run."""
    run_dir, evals = tmp_path / "killed", tmp_path / "evals"  # an empty eval cache: kills may land in the evals
    rng = random.Random(int(os.environ.get("AGL_TEST_KILL_SEED", "0")))
    checkpoints_at_kill = []
    proc = harness(*RUN, f"hydra.run.dir={run_dir}", device=device, eval_cache=evals)
    for point in ("random", "random", "random", "rollout", "update", "checkpoint"):
        if point == "random":
            time.sleep(rng.uniform(2.0, 7.0))
            assert proc.poll() is None, "the run ended before it was killed: " + proc.stdout.read()[-2000:]
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == -signal.SIGKILL, f"the {point} kill point was not reached: {out[-2000:]}"
        checkpoints_at_kill.append(
            (point, [step for (step,) in query(run_dir, "SELECT step FROM checkpoints ORDER BY step")])
        )
        upcoming = {"random": "", "rollout": "update", "update": "checkpoint", "checkpoint": ""}
        next_point = "rollout" if len(checkpoints_at_kill) == 3 else upcoming[point]
        proc = harness(f"resume={run_dir}", kill=next_point, eval_cache=evals)
    finish(proc)

    assert adapter(run_dir) == adapter(reference), checkpoints_at_kill
    assert metrics(run_dir) == metrics(reference), checkpoints_at_kill
    # no rollout failed, every step trained once, the optimizer's step count is continuous
    assert query(run_dir, "SELECT count(*) FROM rollouts WHERE status != 'succeeded'") == [(0,)]
    assert query(run_dir, "SELECT step, policy_version FROM checkpoints ORDER BY step") == [
        (s, s + 1) for s in range(7)
    ]
    died = query(run_dir, "SELECT count(*) FROM attempts WHERE json_extract(metadata, '$.harness_ended') IS NOT NULL")
    assert died[0][0] >= 1  # at least the rollout kill's attempts were handed back, uncharged
