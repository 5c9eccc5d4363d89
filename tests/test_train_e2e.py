"""End to end on the tiny model: real store, real HTTP route, real runners, real GRPO update."""

import json

import torch
from helpers import compose_cfg

from agl.config import to_typed
from agl.runtime import Runtime, succeeded
from agl.train.grpo_trainer import GRPOTrainer
from agl.train.samples import spans_to_samples

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
