"""One seed gives one run, and kill -9 changes nothing (docs/running.md "Resume and reproducibility"), on each device.

Real harness subprocesses on the reference run (tests/runs.py): the same config and seed must end with
byte-identical adapters, metrics and recorded tokens, with or without kills at random moments, inside a
rollout, inside the update and inside a checkpoint write, and with its evals replayed from the eval cache.
(Another seed gives another run: tests/test_loggers.py runs it, with loggers on.)
"""

import json
import os
import random
import shutil
import signal
import time

from runs import (
    ROLLOUTS_PER_STEP,
    RUN,
    STEPS,
    adapter,
    as_saved_before_the_renames,
    finish,
    harness,
    job_started,
    metrics,
    query,
    run,
)

SPANS = (
    "SELECT rollout_id, attempt_id, sequence_id, name, prompt_token_ids, response_token_ids, response_logprobs "
    "FROM spans ORDER BY rollout_id, sequence_id"
)
BEFORE_LAST_STEP = f"SELECT step FROM checkpoints WHERE step >= {STEPS - 2}"  # saved: only the last step is left


def test_one_seed_gives_one_run(reference, tmp_path, device):
    """Again, in a fresh interpreter (the reference and the other runs here are forked: tests/prefork.py),
    with an empty eval cache."""
    again = run(tmp_path / "again", device=device, eval_cache=tmp_path / "evals", fresh=True)
    assert adapter(again) == adapter(reference)
    assert metrics(again) == metrics(reference)
    # the store too: the same rollouts, ids, tokens and log-probs (stored in arrival order, so sorted)
    assert query(again, SPANS) == query(reference, SPANS)


def test_evals_replayed_from_the_cache_change_nothing(reference, tmp_path, device):
    """The reference run filled its eval cache: the same run again with a copy of it replays every eval (the
    same adapters give the same keys), and trains the same adapter through the same rollouts, ids and tokens."""
    shutil.copytree(reference.parent / "evals", tmp_path / "evals")
    again = run(tmp_path / "again", device=device, eval_cache=tmp_path / "evals")
    assert adapter(again) == adapter(reference)
    assert metrics(again) == metrics(reference)
    cached = "SELECT rollout_id FROM rollouts WHERE json_extract(metadata, '$.cached') IS NOT NULL ORDER BY seq"
    evals = "SELECT rollout_id FROM rollouts WHERE json_extract(metadata, '$.eval_step') IS NOT NULL ORDER BY seq"
    replayed = {rid for (rid,) in query(again, cached)}
    assert replayed and query(again, cached) == query(reference, evals)
    assert query(again, SPANS) == [row for row in query(reference, SPANS) if row[0] not in replayed]


def test_kill_9_anywhere_changes_nothing(reference, tmp_path, device):
    """Killed at two random moments, then inside a rollout, inside a step's extra round of draws (dynamic
    sampling), inside the last GRPO update and inside a checkpoint write (so the last resume restores a GRPO
    optimizer that has state), resumed each time: the adapter bytes and metrics of the uninterrupted run, every
    step trained once, and an interrupted step's rollouts, every round's, reused rather than enqueued again.
    After the first kill, the run dir's saved config is rewritten as runs saved it before the loss registry (flat
    loss keys, a Hydra callback by its old module): resumed from it, the run is still the same run."""
    run_dir, evals = tmp_path / "killed", tmp_path / "evals"  # an empty eval cache: kills may land in the evals
    rng = random.Random(int(os.environ.get("AGL_TEST_KILL_SEED", "0")))
    duration = json.loads((reference / "status.json").read_text())["duration_s"]  # the job, model loaded
    checkpoints_at_kill = []
    proc = harness(*RUN, "runner.n=8", f"hydra.run.dir={run_dir}", device=device, eval_cache=evals)
    last_update = f"update:{STEPS - 1}"  # the last GRPO step's: the resume after it restores a GRPO optimizer
    for point in ("random", "random", "rollout", "round", last_update, "checkpoint"):
        if point == "random":  # somewhere in the job (timed from its start, not its process's: a forked one starts
            # in a second, a fresh one in several), and no later than the checkpoint before the last GRPO step:
            # a rollout and that step's update are left for the kill points after it, however loaded the machine
            # was when the reference was timed
            job_started(proc, run_dir)
            deadline = time.monotonic() + rng.uniform(0.0, 0.3 * duration)
            while time.monotonic() < deadline and not query(run_dir, BEFORE_LAST_STEP):
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before it was killed: " + proc.output()[-2000:]
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == -signal.SIGKILL, f"the {point} kill point was not reached: {out[-2000:]}"
        checkpoints_at_kill.append(
            (point, [step for (step,) in query(run_dir, "SELECT step FROM checkpoints ORDER BY step")])
        )
        if len(checkpoints_at_kill) == 1:
            as_saved_before_the_renames(run_dir)
        upcoming = {"random": "", "rollout": "round", "round": last_update, last_update: "checkpoint", "checkpoint": ""}
        next_point = "rollout" if len(checkpoints_at_kill) == 2 else upcoming[point]
        proc = harness(f"resume={run_dir}", kill=next_point, eval_cache=evals)
    finish(proc)

    assert adapter(run_dir) == adapter(reference), checkpoints_at_kill
    assert metrics(run_dir) == metrics(reference), checkpoints_at_kill
    # no rollout failed, every step trained once, the optimizer's step count is continuous
    assert query(run_dir, "SELECT count(*) FROM rollouts WHERE status != 'succeeded'") == [(0,)]
    assert query(run_dir, "SELECT step, policy_version FROM checkpoints ORDER BY step") == [
        (s, s + 1) for s in range(STEPS)
    ]
    # the killed steps' rollouts were reused on resume, not enqueued again: each GRPO step has its own rounds of
    # B x G and the extra draws
    per_step = (
        "SELECT json_extract(metadata, '$.step'), coalesce(json_extract(metadata, '$.round'), 0), count(*) "
        "FROM rollouts WHERE mode = 'train' GROUP BY 1, 2"
    )
    assert query(run_dir, per_step) == query(reference, per_step)
    assert sum(n for _, _, n in query(run_dir, per_step)) == ROLLOUTS_PER_STEP * (STEPS - 1)
    died = query(run_dir, "SELECT count(*) FROM attempts WHERE json_extract(metadata, '$.harness_ended') IS NOT NULL")
    assert died[0][0] >= 1  # at least the rollout kill's attempts were handed back, uncharged
