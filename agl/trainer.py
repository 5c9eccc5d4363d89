"""The GRPO training loop, checkpointed into the store after every step.

One step:
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
import io
import json
import pickle
import random
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from tqdm.auto import tqdm

from agl.adapter import spans_to_samples
from agl.evaluate import evaluate
from agl.grpo import GRPOConfig, GRPOUpdate, advantages
from agl.plots import draw_run_plots
from agl.runtime import Runtime, succeeded


class TaskCursor:
    """Walks a split in a seeded random order, epoch after epoch; its state is two ints."""

    def __init__(self, n_rows: int, seed: int, epoch: int = 0, position: int = 0):
        self.n_rows, self.seed, self.epoch, self.position = n_rows, seed, epoch, position

    def _order(self) -> list[int]:
        order = list(range(self.n_rows))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        picked = []
        while len(picked) < k:
            if self.position >= self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
            picked.append(self._order()[self.position])
            self.position += 1
        return picked

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}


def adapter_bytes(policy: Any) -> bytes:
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(policy.model).items()}
    return save_safetensors(state)


def load_adapter_bytes(policy: Any, blob: bytes) -> None:
    set_peft_model_state_dict(policy.model, load_safetensors(blob))


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class GRPOTrainer:
    def __init__(self, rt: Runtime, cfg: DictConfig):
        self.rt = rt
        self.cfg = cfg
        self.algo = cfg.algo
        self.run_dir = rt.run_dir
        self.train_rows = rt.task.load(cfg.task.train_split)
        eval_rows = rt.task.load(cfg.task.eval_split)
        self.eval_rows = eval_rows[: cfg.task.eval_size] if cfg.task.eval_size else eval_rows
        self.cursor = TaskCursor(len(self.train_rows), cfg.seed)
        self.update = GRPOUpdate(rt.policy, GRPOConfig.from_cfg(self.algo))
        self.step = 0
        self.metrics_path = self.run_dir / "metrics.jsonl"

    # ------------------------------------------------------------------ state

    async def restore(self) -> bool:
        """Load the last checkpoint, if any. True when resuming."""
        store = self.rt.store
        checkpoint = await store.load_checkpoint()
        if checkpoint is None:
            await store.set_run_info("config", OmegaConf.to_container(self.cfg, resolve=True))
            await self._eval_if_due(step=0)
            return False
        load_adapter_bytes(self.rt.policy, checkpoint.blobs["adapter"])
        self.update.optimizer.load_state_dict(torch.load(io.BytesIO(checkpoint.blobs["optimizer"]), weights_only=False))
        rng = pickle.loads(checkpoint.blobs["rng"])
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        self.rt.engine.generator.set_state(rng["engine"])
        self.cursor = TaskCursor(len(self.train_rows), self.cfg.seed, **checkpoint.state["cursor"])
        self.step = checkpoint.step + 1
        self.rt.policy.version = checkpoint.policy_version
        self._rewrite_metrics_file([{"step": s, **m} for s, m in (await store.query_metrics()).items()])
        return True

    async def checkpoint(self, metrics: dict) -> None:
        rng = {"python": random.getstate(), "torch": torch.get_rng_state(), "engine": self.rt.engine.generator.get_state()}
        await self.rt.store.save_checkpoint(
            self.step,
            self.rt.policy.version,
            state={"cursor": self.cursor.state()},
            blobs={"adapter": adapter_bytes(self.rt.policy), "optimizer": torch_bytes(self.update.optimizer.state_dict()), "rng": pickle.dumps(rng)},
            metrics=metrics,
        )

    def _rewrite_metrics_file(self, rows: list) -> None:
        with open(self.metrics_path, "w") as f:
            for row in rows:
                f.write(json.dumps(_plain(row)) + "\n")

    # ------------------------------------------------------------------ loop

    async def train(self) -> dict:
        resumed = await self.restore()
        steps = self.algo.steps
        with tqdm(total=steps, initial=self.step, desc="steps", dynamic_ncols=True, disable=not self.cfg.progress) as bar:
            while self.step < steps:
                metrics = await self.train_step()
                metrics.update(await self._eval_if_due(self.step + 1))
                await self.checkpoint(metrics)
                self._append_metrics(metrics)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", version=metrics["policy_version"])
                bar.update(1)
                self.step += 1
        final_dir = self.run_dir / "adapter"
        await asyncio.to_thread(self.rt.policy.save_adapter, final_dir)
        return {"resumed": resumed, "steps": self.step, "adapter": str(final_dir)}

    async def train_step(self) -> dict:
        rt, algo, step = self.rt, self.algo, self.step
        started = time.perf_counter()
        picked = self.cursor.take(algo.batch_size)
        resources_id = await rt.resources_id(rt.task.resources_for(self.cfg.task.prompt))
        sampling = {"temperature": algo.temperature, "top_p": algo.top_p, "max_tokens": algo.max_tokens}
        inputs, metadata = [], []
        for g, index in enumerate(picked):
            row = self.train_rows[index]
            for _ in range(algo.group_size):
                inputs.append(row)
                metadata.append({"step": step, "group": f"{step}-{g}", "task_id": row.get("id"), "sampling": sampling})
        existing = await rt.store.query_rollouts(step=step)  # a resumed step's rollouts
        prefilled_before = rt.engine.stats["prefill_tokens"]
        rollouts = await rt.run_rollouts(inputs, metadata, mode="train", resources_id=resources_id, existing=existing, desc=f"step {step}")
        rollout_s = time.perf_counter() - started

        samples, rewards = [], []
        for rollout in succeeded(rollouts):
            spans = await rt.store.query_spans(rollout.rollout_id, "latest")
            rollout_samples = spans_to_samples(spans, group=rollout.metadata["group"])
            samples += rollout_samples
            if rollout_samples:
                rewards.append(rollout_samples[0].reward)
        kept, advs, adv_stats = advantages(samples, algo.scale_rewards, algo.drop_zero_std)

        update_started = time.perf_counter()
        update_metrics: dict[str, Any] = {}
        if kept:
            async with rt.engine.paused():  # no forward pass may run while weights change
                update_metrics = await asyncio.to_thread(self.update.step, kept, advs)
                rt.policy.version += 1
        update_s = time.perf_counter() - update_started

        rewards_t = torch.tensor(rewards) if rewards else torch.zeros(1)
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
            "prompt_tokens": rt.engine.stats["prefill_tokens"] - prefilled_before,  # prefilled: shared prompts count once
            "time_rollout_s": rollout_s,
            "time_update_s": update_s,
            "time_other_s": total_s - rollout_s - update_s,
            **adv_stats,
            **update_metrics,
        }

    async def _eval_if_due(self, step: int) -> dict:
        every = self.algo.eval_every
        due = step == 0 or (every and step % every == 0) or step == self.algo.steps
        if not due or not self.eval_rows:
            return {}
        return {f"eval/{k}": v for k, v in (await self.evaluate(step)).items()}

    async def evaluate(self, step: int) -> dict:
        rt = self.rt
        sampling = {"temperature": 0.0, "max_tokens": self.algo.max_tokens}
        summary = await evaluate(
            rt, self.eval_rows, resources=rt.task.resources_for(self.cfg.task.prompt), sampling=sampling,
            tag={"eval_step": step}, desc=f"eval@{step}",
        )
        if step == 0:  # the baseline, before any update: logged as step -1
            baseline = {"policy_version": rt.policy.version, **{f"eval/{k}": v for k, v in summary.items()}}
            await rt.store.log_metrics(-1, baseline)
            self._append_metrics({"step": -1, **baseline})
        return summary

    def _append_metrics(self, metrics: dict) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(_plain(metrics)) + "\n")
        draw_run_plots(self.metrics_path, self.run_dir)


def _plain(row: Any) -> Any:
    return {k: (float(v) if isinstance(v, (torch.Tensor,)) else v) for k, v in dict(row).items()}


async def train(cfg: DictConfig, run_dir: Path) -> dict:
    async with Runtime(cfg, run_dir) as rt:
        trainer = GRPOTrainer(rt, cfg)
        return await trainer.train()
