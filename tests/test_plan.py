"""A training job says what is coming (agl/train/plan.py) and, at its end, what it learned (agl/jobs/ending.py)."""

import functools
import random

import torch
from helpers import typed_cfg

from agl.jobs import grpo
from agl.runtime import Runtime
from agl.train.plan import measure_rates, probe_prompt
from agl.train.sft import sft_loss_and_backward

RUN = [
    "model=tiny",
    "progress=false",
    "runner.n=8",
    "task=hello",
    "task.agent=crash_points:multi_turn_agent",
    "task.data=crash_points:load",
    "task.max_tokens=6",
    "+task.resources.max_turns=2",
    "+task.resources.never_solved_every=1",  # every reward 0: no GRPO step learns, and the job says so
    "task.eval_size=4",
    "task.final_eval_size=6",
    "algo=grpo",
    "algo.steps=3",
    "algo.batch_size=2",
    "algo.group_size=4",
    "algo.micro_batch_size=4",
    "algo.lr=3e-2",
    "algo.eval_every=1",
    "algo.warmup.steps=1",
    "algo.warmup.batch_size=4",
]


def test_a_job_prints_its_plan_each_phase_as_it_ends_and_what_it_learned(tmp_path, capsys, caplog):
    grpo.run(typed_cfg(RUN), tmp_path)
    out = capsys.readouterr().out
    # 3 GRPO steps in a row with no informative group: one line says so, and what to try
    [warning] = [r.getMessage() for r in caplog.records if "learned little" in r.getMessage()]
    assert "the last 3 GRPO steps" in warning and "algo.dynamic_sampling=true" in warning
    plan = out[out.index("plan (rates measured here") :]
    phases = ["baseline eval", "SFT warm-up", "warm-up eval", "GRPO", "evals", "final eval"]
    for i, phase in enumerate(phases, 1):
        assert f"  {i}. {phase}" in plan
        assert f"phase {i} of 6 done, {phase}: " in out, out
    # the warm-up's end on the final eval's 6 problems; the periodic evals after steps 2 and 3 of 4 on the slice
    assert "warm-up eval   6 problems" in plan and "2 x 4 problems" in plan, plan
    title = "base model -> after the SFT warm-up (1 step) -> after GRPO (3 steps), the same 6 tasks"
    assert title in out, out[-2500:]
    table = out[out.index(title) :]
    assert "| said_a " in table and "McNemar exact p" in table and "GRPO's change" in table
    for line in (f"report:  {tmp_path / 'report.md'}", f"resume:  python harness.py resume={tmp_path}"):
        assert line in out
    assert (tmp_path / "report.md").is_file() and (tmp_path / "curves.png").is_file()


async def test_measuring_the_rates_changes_nothing_the_job_computes(tmp_path):
    cfg = typed_cfg(RUN)
    async with Runtime.of(cfg, tmp_path) as rt:
        lora = {n: p.detach().clone() for n, p in rt.policy.model.named_parameters() if p.requires_grad}
        states = (torch.get_rng_state(), random.getstate(), rt.engine.generator.get_state())
        prompt = probe_prompt(rt, rt.task.load("test"), cfg.task.prompt)
        backward = functools.partial(sft_loss_and_backward, gradient_checkpointing=True)
        rates = await measure_rates(rt, prompt, 8, 6, len(prompt) + 6, backward)
        assert (
            rates.decode_step_s > 0
            and rates.decode_last_step_s > 0
            and rates.train_s_per_token > 0
            and rates.batch == 8
        )
        assert torch.equal(states[0], torch.get_rng_state()) and states[1] == random.getstate()
        assert torch.equal(states[2], rt.engine.generator.get_state())
        for name, param in rt.policy.model.named_parameters():
            if param.requires_grad:
                assert torch.equal(param, lora[name]) and param.grad is None
        assert not rt.policy.model.training
