"""The GRPO training loop, checkpointed into the store after every step.

With ``algo.warmup.steps`` > 0 the job first runs that many SFT steps on the task's
demonstrations (``agl.train.sft.SFTStage``): the base model's samples may never earn a reward
(GSM8K's never reach a well-formed answer), and GRPO can only amplify what it samples.
Warm-up steps are steps 0..W-1 of the same store, checkpointed and resumed like GRPO's
(their own cursor and optimizer); GRPO's steps are W..W+steps-1.

One GRPO step:
  1. sample B tasks (a seeded, resumable cursor) and enqueue G rollouts for each;
  2. wait for them (runners run the agent; the route records spans);
  3. adapt spans to samples and compute group advantages;
  4. update the LoRA with serving paused; bump the policy version;
  5. checkpoint (adapter, optimizer, cursor, RNG, metrics) in one store transaction;
  6. every ``eval_every`` steps, evaluate on a fixed held-out slice.

Resume: a killed run reopens its store, restores the last checkpoint, and re-enters the
interrupted step; that step's rollouts are found by ``metadata.step`` and reused (the
finished ones as they are; the store requeued the ones the dead process was running).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from agl.agents.api import final_reward
from agl.config import GRPOConfig, typed
from agl.eval.evaluate import end_eval_rows, eval_during_training
from agl.eval.failures import check_rollouts
from agl.report.metrics import append_metrics, draw_curves
from agl.runtime import Runtime, succeeded
from agl.train.grpo import GRPOUpdate, advantages, drop_groups
from agl.train.resume import TaskCursor, log_baseline, resume_or_start, save_checkpoint
from agl.train.samples import spans_to_samples
from agl.train.sft import SFTStage


class GRPOTrainer:
    def __init__(self, rt: Runtime, algo: GRPOConfig):
        """``algo``: ``algo=grpo``'s section; the task's splits, seed and progress bars are the runtime's."""
        self.rt = rt
        self.algo = algo = typed(GRPOConfig, algo)
        task = rt.task_config
        self.run_dir = rt.run_dir
        self.train_rows = rt.task.load(task.train_split)
        eval_rows = rt.task.load(task.eval_split)
        self.eval_rows = eval_rows[: task.eval_size] if task.eval_size else eval_rows
        # the baseline and the final eval: eval_rows and a seeded choice of the rest, for the paired test at the end
        self.end_rows = end_eval_rows(eval_rows, task.eval_size, task.final_eval_size, task.final_eval_seed)
        self.cursor = TaskCursor(len(self.train_rows), rt.seed)
        self.update = GRPOUpdate(rt.policy, algo)
        warmup = self.algo.warmup
        self.warmup = SFTStage(rt, warmup) if warmup.steps or warmup.epochs else None
        self.warmup_steps = self.warmup.steps if self.warmup else 0
        self.total_steps = self.warmup_steps + self.algo.steps
        self.step = 0  # warm-up steps first, then GRPO's

    # ------------------------------------------------------------------ state

    async def restore(self) -> bool:
        """Load the last checkpoint, if any. True when resuming; a fresh run evaluates a baseline."""
        checkpoint = await resume_or_start(self.rt, self._optimizer_for)
        if checkpoint is None:
            if baseline := await self._eval_if_due(step=0):
                await log_baseline(self.rt, baseline)
            return False
        self.cursor = TaskCursor(len(self.train_rows), self.rt.seed, **checkpoint.state["cursor"])
        if self.warmup and "sft_cursor" in checkpoint.state:
            self.warmup.restore_cursor(checkpoint.state["sft_cursor"])
        self.step = checkpoint.step + 1
        return True

    def _optimizer_for(self, state: dict) -> torch.optim.Optimizer:
        """The optimizer a checkpoint saved: the warm-up's until GRPO has taken a step."""
        return self.warmup.optimizer if state.get("stage") == "sft" else self.update.optimizer

    def _state(self, stage: str) -> dict:
        state = {"stage": stage, "cursor": self.cursor.state()}
        return state | ({"sft_cursor": self.warmup.cursor.state()} if self.warmup else {})

    # ------------------------------------------------------------------ loop

    async def train(self) -> dict:
        resumed = await self.restore()
        with tqdm(
            total=self.total_steps, initial=self.step, desc="steps", dynamic_ncols=True, disable=not self.rt.progress
        ) as bar:
            while self.step < self.total_steps:
                stage = "sft" if self.step < self.warmup_steps else "grpo"
                if stage == "sft":
                    metrics = await self.warmup.train_step(self.step)
                    metrics["sft_loss"] = metrics.pop("loss")  # a likelihood, not GRPO's surrogate: its own curve
                    optimizer = self.warmup.optimizer
                else:
                    metrics = await self.train_step()
                    optimizer = self.update.optimizer
                metrics["stage"] = stage
                metrics.update(await self._eval_if_due(self.step + 1))
                await save_checkpoint(self.rt, self.step, self._state(stage), optimizer, metrics)
                append_metrics(self.run_dir, metrics)
                shown = (
                    {"sft_loss": f"{metrics['sft_loss']:.3f}"}
                    if stage == "sft"
                    else {"reward": f"{metrics['reward_mean']:.3f}"}
                )
                bar.set_postfix(**shown, version=metrics["policy_version"])
                bar.update(1)
                self.step += 1
        final_dir = self.run_dir / "adapter"
        await asyncio.to_thread(self.rt.policy.save_adapter, final_dir)
        draw_curves(self.run_dir)
        return {"resumed": resumed, "steps": self.step, "adapter": str(final_dir)}

    async def train_step(self) -> dict:
        rt, algo, step = self.rt, self.algo, self.step
        started = time.perf_counter()
        picked = self.cursor.take(algo.batch_size)
        resources_id = await rt.resources_id(rt.task.resources_for(rt.task_config.prompt))
        sampling = {"temperature": algo.temperature, "top_p": algo.top_p, "max_tokens": algo.max_tokens}
        inputs, metadata = [], []
        for g, index in enumerate(picked):
            row = self.train_rows[index]
            for _ in range(algo.group_size):
                inputs.append(row)
                metadata.append({"step": step, "group": f"{step}-{g}", "task_id": row.get("id"), "sampling": sampling})
        existing = await rt.store.query_rollouts(step=step)  # a resumed step's rollouts
        prefilled_before = rt.engine.stats["prefill_tokens"]
        rollouts = await rt.run_rollouts(
            inputs, metadata, mode="train", resources_id=resources_id, existing=existing, desc=f"step {step}"
        )
        await check_rollouts(rt.store, rollouts, f"training step {step}")  # all failed: nothing to learn, the job fails
        rollout_s = time.perf_counter() - started

        finished = succeeded(rollouts)
        samples: list = []
        rewards = {
            r.rollout_id: 0.0 for r in rollouts
        }  # reward_mean counts every rollout, a failed one as 0, as eval/reward does
        for rollout in finished:
            spans = await rt.store.query_spans(rollout.rollout_id, "latest")
            reward = final_reward(spans)
            samples += spans_to_samples(spans, reward=reward, group=rollout.metadata["group"])
            rewards[rollout.rollout_id] = reward or 0.0
        advs, flat = advantages(samples, algo.scale_rewards)
        kept, advs = drop_groups(samples, advs, flat) if algo.drop_zero_std else (samples, advs)
        groups = len({s.group for s in samples})

        update_started = time.perf_counter()
        update_metrics: dict[str, Any] = {}
        if kept:
            async with rt.engine.paused():  # no forward pass may run while weights change
                update_metrics = await asyncio.to_thread(self.update.step, kept, advs)
                rt.policy.version += 1
        update_s = time.perf_counter() - update_started

        rewards_t = torch.tensor(list(rewards.values())) if rewards else torch.zeros(1)
        lengths = [s.num_sampled for s in samples]
        total_s = time.perf_counter() - started
        return {
            "step": step,
            "policy_version": rt.policy.version,
            "reward_mean": float(rewards_t.mean()),
            "reward_std": float(rewards_t.std()) if len(rewards) > 1 else 0.0,
            "rollouts": len(rollouts),
            "rollouts_failed": len(rollouts) - len(finished),
            "samples_trained": len(kept),
            "completion_len_mean": sum(lengths) / max(len(lengths), 1),
            "completion_len_max": max(lengths, default=0),
            "truncated_frac": sum(s.truncated for s in samples) / max(len(samples), 1),
            "tokens_per_s": sum(lengths) / max(rollout_s, 1e-9),
            "prompt_tokens": rt.engine.stats["prefill_tokens"]
            - prefilled_before,  # prefilled: shared prompts count once
            "time_rollout_s": rollout_s,
            "time_update_s": update_s,
            "time_other_s": total_s - rollout_s - update_s,
            "frac_reward_zero_std": len(flat) / max(groups, 1),
            "groups": groups,
            **update_metrics,
        }

    async def _eval_if_due(self, step: int) -> dict:
        every = self.algo.eval_every
        warmed_up = self.warmup_steps and step == self.warmup_steps  # what the warm-up alone did
        due = step == 0 or (every and step % every == 0) or step == self.total_steps or warmed_up
        if not due:
            return {}
        end = step in (0, self.total_steps)
        rows = self.end_rows if end else self.eval_rows
        return await eval_during_training(
            self.rt, rows, step, self.algo.max_tokens, slice_size=len(self.eval_rows) if end else 0
        )
