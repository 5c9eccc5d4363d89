"""The GRPO training loop, checkpointed into the store after every step.

With ``algo.warmup.steps`` > 0 the job first runs that many SFT steps on the task's
demonstrations (``agl.train.sft.SFTStage``): the base model's samples may never earn a reward
(GSM8K's never reach a well-formed answer), and GRPO can only amplify what it samples.
Warm-up steps are steps 0..W-1 of the same store, checkpointed and resumed like GRPO's
(their own cursor and optimizer); GRPO's steps are W..W+steps-1.

The baseline, the eval when the warm-up ends and the final eval take the same problems, so the final table
says what each phase changed (the warm-up's change, then GRPO's own, each McNemar-tested).

One GRPO step:
  1. sample B tasks (a seeded, resumable cursor) and enqueue G rollouts for each;
  2. wait for them (runners run the agent; the route records spans); with ``dynamic_sampling``, while fewer
     than B groups have unequal rewards, draw more tasks from the cursor, a round at a time (agl/train/sampling.py);
  3. adapt spans to samples and compute group advantages;
  4. update the LoRA with serving paused; bump the policy version;
  5. checkpoint (adapter, optimizer, cursor, RNG, metrics) in one store transaction;
  6. every ``eval_every`` steps, evaluate on a fixed held-out slice.

Resume: a killed run reopens its store, restores the last checkpoint, and re-enters the
interrupted step; that step's rollouts are found by ``metadata.step`` (and ``metadata.round``) and reused (the
finished ones as they are; the store requeued the ones the dead process was running).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from agl.agents.api import final_reward
from agl.config import GRPOConfig, typed
from agl.eval.evaluate import cached_row_count, end_eval_rows, eval_during_training
from agl.eval.failures import check_rollouts
from agl.policy import compute_thread
from agl.policy.device import device_memory
from agl.report.metrics import append_metrics, draw_curves
from agl.runtime import Runtime, succeeded
from agl.train.advantages import ESTIMATORS, advantages, drop_groups
from agl.train.grpo import GRPOUpdate
from agl.train.plan import JobPlan, Phase, measure_rates, probe_prompt
from agl.train.resume import TaskCursor, log_baseline, resume_or_start, save_checkpoint
from agl.train.samples import spans_to_samples
from agl.train.sampling import GroupDraws, InformativeWatch, group_rewards
from agl.train.sft import SFTStage, sft_loss_and_backward

log = logging.getLogger(__name__)

# the phases of a GRPO job, as its plan names them (agl/train/plan.py)
BASELINE, WARMUP, WARMUP_EVAL, GRPO, EVALS, FINAL = (
    "baseline eval",
    "SFT warm-up",
    "warm-up eval",
    "GRPO",
    "evals",
    "final eval",
)


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
        self.watch = InformativeWatch()  # warns once when steps in a row learn little
        self.update = GRPOUpdate(rt.policy, algo)
        self.estimator = ESTIMATORS.get(algo.advantage)
        warmup = self.algo.warmup
        self.warmup = SFTStage(rt, warmup) if warmup.steps or warmup.epochs else None
        self.warmup_steps = self.warmup.steps if self.warmup else 0
        self.total_steps = self.warmup_steps + self.algo.steps
        self.step = 0  # warm-up steps first, then GRPO's
        self.plan = JobPlan([], None)  # restore() makes the real one

    # ------------------------------------------------------------------ state

    async def restore(self) -> bool:
        """Load the last checkpoint, if any, and say what is left to do (``agl.train.plan``). True when
        resuming; a fresh run evaluates a baseline."""
        checkpoint = await resume_or_start(self.rt, self._optimizer_for)
        if checkpoint is None:
            self.plan = await self._plan(fresh=True)
            self.plan.begin(BASELINE)
            if baseline := await self._eval_if_due(step=0):
                await log_baseline(self.rt, baseline)
            self.plan.tick(BASELINE)
            return False
        self.cursor = TaskCursor(len(self.train_rows), self.rt.seed, **checkpoint.state["cursor"])
        self.watch = InformativeWatch(**checkpoint.state.get("informative", {}))
        if self.warmup and "sft_cursor" in checkpoint.state:
            self.warmup.restore_cursor(checkpoint.state["sft_cursor"])
        self.step = checkpoint.step + 1
        self.plan = await self._plan(fresh=False)
        return True

    def _due(self, step: int) -> bool:
        """An eval runs after ``step`` updates: the baseline, every ``eval_every``, the warm-up's end, the last."""
        every = self.algo.eval_every
        warmed_up = self.warmup_steps and step == self.warmup_steps  # what the warm-up alone did
        return step == 0 or bool(every and step % every == 0) or step == self.total_steps or bool(warmed_up)

    async def _plan(self, fresh: bool) -> JobPlan:
        """This job's remaining phases with their estimates, from rates measured now; printed."""
        rt, algo, task = self.rt, self.algo, self.rt.task_config
        prompt_ids = probe_prompt(rt, self.end_rows, task.prompt)
        tokens = algo.max_tokens
        train_length = len(prompt_ids) + tokens
        backward = functools.partial(sft_loss_and_backward, gradient_checkpointing=algo.gradient_checkpointing)
        rates = await measure_rates(rt, prompt_ids, rt.runner_config.n or 1, tokens, train_length, backward)
        sampling = {"temperature": 0.0, "max_tokens": tokens}
        resources = rt.task.resources_for(task.prompt)
        cached = cached_row_count(rt, self.end_rows, resources, sampling, task.eval_split) if fresh else 0
        n_end, n_slice, p = len(self.end_rows), len(self.eval_rows), len(prompt_ids)
        warmup_left = max(0, self.warmup_steps - self.step)
        grpo_left = self.algo.steps - max(0, self.step - self.warmup_steps)
        warmup_eval = int(self.step < self.warmup_steps < self.total_steps and n_end > 0)  # on the end's problems
        periodic = sum(self._due(s) for s in range(self.step + 1, self.total_steps) if s != self.warmup_steps)
        phases = [
            Phase(
                BASELINE,
                f"{n_end} problems" + (f" ({cached} from the eval cache)" if cached else ""),
                rates.eval_s(n_end - cached, p, tokens),
                units=int(fresh and n_end > 0),
            )
        ]
        if self.warmup:
            demos = [self.warmup.example(i) for i in range(min(16, len(self.warmup.demos)))]
            mean_length = sum(len(ids) for ids, _ in demos) / len(demos)
            step_s = self.warmup.sft_cfg.batch_size * mean_length * rates.train_s_per_token
            phases.append(
                Phase(
                    WARMUP,
                    f"{warmup_left} steps x {self.warmup.sft_cfg.batch_size} demonstrations",
                    warmup_left * step_s,
                    units=warmup_left,
                )
            )
            phases.append(Phase(WARMUP_EVAL, f"{n_end} problems", rates.eval_s(n_end, p, tokens), units=warmup_eval))
        rollouts = algo.batch_size * algo.group_size
        sample_s = algo.batch_size * p * rates.prefill_s_per_token + rates.decode_s(rollouts, tokens)
        update_s = rollouts * train_length * rates.train_s_per_token * algo.num_iterations * (1 + (algo.beta > 0) / 3)
        phases.append(
            Phase(
                GRPO,
                f"{grpo_left} steps x {rollouts} rollouts"
                + (f" (+ up to {algo.max_extra_groups * algo.group_size})" if algo.dynamic_sampling else ""),
                grpo_left * (sample_s + update_s),
                units=grpo_left,
            )
        )
        phases.append(
            Phase(
                EVALS,
                f"{periodic} x {n_slice} problems",
                periodic * rates.eval_s(n_slice, p, tokens),
                units=periodic,
            )
        )
        phases.append(
            Phase(
                FINAL,
                f"{n_end} problems",
                rates.eval_s(n_end, p, tokens),
                units=int(self.step < self.total_steps and n_end > 0),
            )
        )
        plan = JobPlan(phases, rates)
        plan.announce()
        return plan

    def _optimizer_for(self, state: dict) -> torch.optim.Optimizer:
        """The optimizer a checkpoint saved: the warm-up's until GRPO has taken a step."""
        return self.warmup.optimizer if state.get("stage") == "sft" else self.update.optimizer

    def _state(self, stage: str) -> dict:
        state = {"stage": stage, "cursor": self.cursor.state(), "informative": self.watch.state()}
        return state | ({"sft_cursor": self.warmup.cursor.state()} if self.warmup else {})

    # ------------------------------------------------------------------ loop

    async def train(self) -> dict:
        resumed = await self.restore()
        with tqdm(
            total=self.total_steps, initial=self.step, desc="steps", dynamic_ncols=True, disable=not self.rt.progress
        ) as bar:
            while self.step < self.total_steps:
                stage = "sft" if self.step < self.warmup_steps else "grpo"
                self.plan.begin(WARMUP if stage == "sft" else GRPO)
                if stage == "sft":
                    metrics = await self.warmup.train_step(self.step)
                    metrics["sft_loss"] = metrics.pop("loss")  # a likelihood, not GRPO's surrogate: its own curve
                    optimizer = self.warmup.optimizer
                else:
                    metrics = await self.train_step()
                    optimizer = self.update.optimizer
                    warning = self.watch.check(metrics["informative_share"], self.algo)  # saved with the step
                metrics["stage"] = stage
                self.plan.tick(WARMUP if stage == "sft" else GRPO)
                metrics.update(await self._eval_if_due(self.step + 1))
                await save_checkpoint(self.rt, self.step, self._state(stage), optimizer, metrics)
                append_metrics(self.run_dir, metrics)
                if stage == "sft":
                    shown = {"sft_loss": f"{metrics['sft_loss']:.3f}"}
                else:  # the groups that taught something, of those drawn
                    shown = {
                        "reward": f"{metrics['reward_mean']:.3f}",
                        "informative": f"{metrics['groups_informative']}/{metrics['groups_drawn']}",
                    }
                    if warning:  # once a job: several steps in a row learned little
                        log.warning(warning)
                bar.set_postfix(**shown, version=metrics["policy_version"])
                bar.update(1)
                self.step += 1
        final_dir = self.run_dir / "adapter"
        await compute_thread.run(self.rt.policy.save_adapter, final_dir)
        draw_curves(self.run_dir)
        return {"resumed": resumed, "steps": self.step, "adapter": str(final_dir)}

    async def train_step(self) -> dict:
        rt, algo, step = self.rt, self.algo, self.step
        started = time.perf_counter()
        resources_id = await rt.resources_id(rt.task.resources_for(rt.task_config.prompt))
        sampling = {"temperature": algo.temperature, "top_p": algo.top_p, "max_tokens": algo.max_tokens}
        existing = await rt.store.query_rollouts(step=step)  # a resumed step's rollouts, every round's
        prefilled_before = rt.engine.stats["prefill_tokens"]
        # B tasks, then with dynamic sampling rounds of more until B groups have unequal rewards (agl/train/sampling.py)
        draws = GroupDraws(algo.batch_size, algo.max_extra_groups if algo.dynamic_sampling else 0)
        rollouts, samples = [], []
        rewards = {}  # reward_mean counts every rollout, a failed one as 0, as eval/reward does
        while size := draws.next_round():
            r, first = draws.rounds, draws.drawn
            groups = [f"{step}-{g}" for g in range(first, first + size)]
            inputs, metadata = [], []
            for group, index in zip(groups, self.cursor.take(size)):
                row = self.train_rows[index]
                for _ in range(algo.group_size):
                    inputs.append(row)
                    metadata.append({"step": step, "group": group, "task_id": row.get("id"), "sampling": sampling})
                    if r:  # the first round's metadata is what it was before rounds existed
                        metadata[-1]["round"] = r
            got = await rt.run_rollouts(
                inputs,
                metadata,
                mode="train",
                resources_id=resources_id,
                existing=[x for x in existing if (x.metadata or {}).get("round", 0) == r],
                desc=f"step {step}" + (f" round {r}" if r else ""),
            )
            # all failed: nothing to learn, the job fails
            await check_rollouts(rt.store, got, f"training step {step}" + (f" round {r}" if r else ""))
            round_samples: list = []
            for rollout in got:
                rewards[rollout.rollout_id] = 0.0
            for rollout in succeeded(got):
                spans = await rt.store.query_spans(rollout.rollout_id, "latest")
                reward = final_reward(spans)
                round_samples += spans_to_samples(spans, reward=reward, group=rollout.metadata["group"])
                rewards[rollout.rollout_id] = reward or 0.0
            draws.add(groups, group_rewards(round_samples))
            rollouts += got
            samples += round_samples
        rollout_s = time.perf_counter() - started

        if algo.dynamic_sampling:  # the first B informative groups; their advantages among themselves
            kept_groups = set(draws.kept())
            trained = [s for s in samples if s.group in kept_groups]
        else:
            trained = samples
        advs, flat = advantages(trained, self.estimator)
        kept, advs = drop_groups(trained, advs, flat) if algo.drop_zero_std else (trained, advs)
        groups = len({s.group for s in samples})

        update_started = time.perf_counter()
        update_metrics: dict[str, Any] = {}
        if kept:
            async with rt.engine.paused():  # no forward pass may run while weights change
                update_metrics = await compute_thread.run(self.update.step, kept, advs)
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
            "rollouts_failed": len(rollouts) - len(succeeded(rollouts)),
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
            "frac_reward_zero_std": draws.flat / max(groups, 1),
            "groups": groups,
            **draws.metrics(trained=len({s.group for s in kept})),
            **update_metrics,
            **device_memory(rt.policy.device),  # peak_vram_mib on CUDA
        }

    async def _eval_if_due(self, step: int) -> dict:
        if not self._due(step):
            return {}
        # the baseline, the warm-up's end and the last eval take the final eval's problems: each phase's change is
        # paired on the same ones (the final eval compares with both)
        warmed_up = bool(self.warmup_steps) and step == self.warmup_steps
        end = step in (0, self.total_steps) or warmed_up
        rows = self.end_rows if end else self.eval_rows
        phase = BASELINE if step == 0 else FINAL if step == self.total_steps else WARMUP_EVAL if warmed_up else EVALS
        if step:  # the baseline's phase is timed around its logging too (restore)
            self.plan.begin(phase)
        metrics = await eval_during_training(
            self.rt,
            rows,
            step,
            self.algo.max_tokens,
            slice_size=len(self.eval_rows) if end else 0,
            rl_from=self.warmup_steps if self.warmup_steps and step == self.total_steps else None,
        )
        if step:
            self.plan.tick(phase)
        return metrics
