"""End to end on the tiny model: real store, real HTTP route, real runners, real GRPO update."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from agl.config import to_typed
from agl.runtime import Runtime, succeeded
from agl.store import SqliteStore
from agl.train.grpo_trainer import GRPOTrainer
from agl.train.samples import spans_to_samples

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = [
    "model=tiny",
    "algo=grpo",
    "progress=false",
    "runner.n=8",
    "task=hello",
    "task.agent=e2e_agents:multi_turn_agent",
    "task.data=e2e_agents:load",
    "task.max_tokens=6",
    "+task.resources.max_turns=3",
    "algo.batch_size=2",
    "algo.group_size=4",
    "algo.micro_batch_size=4",
    "algo.lr=1e-2",
]


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def lora_state(policy):
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


async def test_grpo_steps_through_the_route_change_the_lora(tmp_path, device):
    # a multi-turn agent: its calls must merge into one sample per rollout
    cfg = compose_cfg(TINY_RUN + ["algo.steps=2", "algo.eval_every=0", "task.eval_size=4", f"device={device}"])
    async with Runtime.of(to_typed(cfg), tmp_path) as rt:
        trainer = GRPOTrainer(rt, to_typed(cfg).algo)
        before = lora_state(rt.policy)
        result = await trainer.train()
        after = lora_state(rt.policy)
        assert result["steps"] == 2 and rt.policy.version == 2
        assert any(not torch.equal(before[n], after[n]) for n in before), "the LoRA did not change"
        rollouts = await rt.store.query_rollouts(step=0)
        assert len(rollouts) == 8 and len(succeeded(rollouts)) == 8
        for rollout in succeeded(rollouts):
            spans = await rt.store.query_spans(rollout.rollout_id, "latest")
            calls = [s for s in spans if s.name == "llm.chat"]
            [sample] = spans_to_samples(spans, group="g")
            assert sample.num_sampled == sum(len(c.response_token_ids) for c in calls)
            assert len(calls) == 3 and sum(sample.mask) < len(sample.mask)  # user turns masked out
            assert (
                sample.prompt_ids + sample.completion_ids == calls[-1].prompt_token_ids + calls[-1].response_token_ids
            )
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "curves.png").is_file()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [-1, 0, 1]  # baseline eval + 2 steps
    # the trainer's first-pass logprobs reproduce what the route recorded while sampling
    assert lines[1]["logprob_diff_abs"] < 1e-3, lines[1]["logprob_diff_abs"]
    # the GPU's peak memory, on CUDA only (torch.cuda.max_memory_allocated), in every step's row
    if device == "cuda":
        assert all(line["peak_vram_mib"] > 0 for line in lines[1:]), lines
    else:
        assert not any("peak_vram_mib" in line for line in lines)


def test_kill_and_resume_continues_at_the_last_committed_step(tmp_path, device):
    """SIGKILL a real training process mid-run; resuming finishes with the step count intact."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "harness.py", *TINY_RUN, "algo.steps=4", "algo.eval_every=0", f"hydra.run.dir={run_dir}"]
    args.append(f"device={device}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    store_path = run_dir / "store.sqlite"
    deadline = time.time() + 240
    # wait until step 1 is committed and step 2's rollouts are under way, then kill
    while time.time() < deadline:
        if store_path.exists() and _checkpoint_steps(store_path) >= {0, 1}:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("training never committed step 1:\n" + proc.stdout.read().decode()[-3000:])
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = _checkpoint_steps(store_path)
    rollouts_before = _rollout_ids(store_path)

    resumed = subprocess.run(
        [sys.executable, "harness.py", f"resume={run_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _checkpoint_steps(store_path) == {0, 1, 2, 3}
    versions = asyncio.run(_policy_versions(store_path))
    assert versions == sorted(versions) and versions[-1] >= max(committed) + 1
    # rollouts of the interrupted step were reused, not enqueued again
    after = _rollout_ids(store_path)
    interrupted = max(committed) + 1
    assert rollouts_before.get(interrupted, set()) <= after.get(interrupted, set())
    assert len(after.get(interrupted, set())) == 8
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def _checkpoint_steps(path):
    import sqlite3

    with sqlite3.connect(path, timeout=30) as conn:
        try:
            return {row[0] for row in conn.execute("SELECT step FROM checkpoints")}
        except sqlite3.OperationalError:
            return set()


def _rollout_ids(path):
    import sqlite3

    out = {}
    with sqlite3.connect(path, timeout=30) as conn:
        for rid, step in conn.execute("SELECT rollout_id, json_extract(metadata, '$.step') FROM rollouts"):
            if step is not None:
                out.setdefault(step, set()).add(rid)
    return out


async def _policy_versions(path):
    store = SqliteStore.open_readonly(path)
    try:
        return [c.policy_version for c in await store.list_checkpoints()]
    finally:
        await store.close()
