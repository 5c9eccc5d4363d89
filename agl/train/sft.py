"""``algo=sft``: supervised fine-tuning of the LoRA on the task's demonstrations.

Each demonstration is a conversation (``list[message]``) from ``task.demonstrations``. It is
rendered through the model's chat template (``policy.render_chat``, as the route renders an
agent's calls), and the loss is the mean negative log-likelihood of the assistant tokens
only: every assistant turn's content and its end-of-turn token; the system/user turns and
the template's headers are masked out.

The loop mirrors GRPO's: a seeded resumable cursor over the demonstrations, micro-batched
forward/backward with the engine paused, AdamW, a checkpoint in the store after every step
(adapter, optimizer, cursor, RNG; ``agl.train.resume``), ``metrics.jsonl`` and ``curves.png``,
optional greedy evals through the route (before the first step, every ``eval_every`` steps
and after the last), and the final LoRA in ``<run dir>/adapter`` — which a later run picks up
with ``model.adapter=<run dir>`` (SFT, then GRPO).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from agl.config import SFTConfig, typed
from agl.errors import ConfigError
from agl.eval.evaluate import eval_during_training
from agl.memory import update_memory
from agl.policy import compute_thread
from agl.policy.device import device_memory
from agl.report.metrics import append_metrics, draw_curves, metrics_path
from agl.runtime import Runtime
from agl.train.micro_batches import sft_micro_batches
from agl.train.plan import JobPlan, Phase, measure_rates, probe_prompt
from agl.train.resume import TaskCursor, log_baseline, resume_or_start, save_checkpoint


def render_demonstration(
    policy: Any, messages: Sequence[dict], max_length: int | None = None
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation: mask 1 on assistant content + end-of-turn.

    Assistant turn i spans from the end of ``render(messages[:i], add_generation_prompt=True)``
    to the end of ``render(messages[:i+1])``; the mask stops at the first end-of-turn (eos)
    token in that span, so what the template appends after it (e.g. a newline) is not learned.
    """
    messages = list(messages)
    if not any(m.get("role") == "assistant" for m in messages):
        raise ConfigError("a demonstration has no assistant turn to learn from")
    ids = policy.render_chat(messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    eos = set(policy.eos_token_ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = policy.render_chat(messages[:i], add_generation_prompt=True)
        turn = policy.render_chat(messages[: i + 1], add_generation_prompt=False)
        if ids[: len(prefix)] != prefix or ids[: len(turn)] != turn:
            raise ConfigError(
                "the chat template does not render a conversation's prefixes as prefixes; SFT masking needs that"
            )
        for t in range(len(prefix), len(turn)):
            mask[t] = 1
            if ids[t] in eos:
                break
    if max_length:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def sft_loss_and_backward(
    policy: Any,
    examples: Sequence[tuple[list[int], list[int]]],
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    gradient_checkpointing: bool = False,
) -> dict:
    """Accumulate gradients of the token-mean NLL over all ``examples`` (one optimizer step).

    Only the assistant positions reach the vocabulary: with a plain output layer
    (``agl.train.forward.fused_head``) the decoder's hidden states there go through the fused log-prob
    head, so no [B, T, V] logits exist. A GSM8K micro-batch of 4 x ~250 tokens used to make
    ~200 MB of fp32 logits, as much again for their log-softmax and again for its gradient, for
    the ~40% of positions that carry loss.
    """
    from agl.train.activation_checkpointing import checkpointed_layers
    from agl.train.forward import fused_head
    from agl.train.merged_lora import dequantized_4bit_layers, merged_lora_layers

    pad_id = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else policy.eos_token_ids[0]
    total_tokens = sum(sum(mask) for _, mask in examples)
    if total_tokens == 0:
        return {"loss": float("nan"), "train_tokens": 0}
    head = fused_head(policy)
    loss_sum = 0.0
    # activations of one layer at a time (agl/train/activation_checkpointing.py);
    # LoRA layers as one matmul each, or their 4-bit base weights dequantized once (agl/train/merged_lora.py)
    with (
        checkpointed_layers(policy.model, gradient_checkpointing),
        merged_lora_layers(policy.model, policy.train_merged),
        dequantized_4bit_layers(policy.model, policy.keeps_dequantized),
    ):
        for indices in sft_micro_batches([len(ids) for ids, _ in examples], micro_batch_size, micro_batch_tokens):
            loss_sum += _micro_batch_backward(policy, [examples[i] for i in indices], head, total_tokens, pad_id)
    return {"loss": loss_sum, "train_tokens": total_tokens}


def _micro_batch_backward(
    policy: Any, chunk: Sequence[tuple[list[int], list[int]]], head: Any, total_tokens: int, pad_id: int
) -> float:
    """One micro-batch's forward and backward of its share of the token-mean NLL; that share."""
    from agl.train.logprobs import token_logprobs

    model = policy.model.get_base_model()
    device = policy.device
    length = max(len(ids) for ids, _ in chunk)
    input_ids_BT = torch.full((len(chunk), length), pad_id, dtype=torch.long)
    attention_BT = torch.zeros((len(chunk), length), dtype=torch.long)
    learn_BT = torch.zeros(
        (len(chunk), length), dtype=torch.bool
    )  # position t is learned: its token is predicted at t-1
    for row, (ids, mask) in enumerate(chunk):  # right padding: positions start at 0 for every row
        input_ids_BT[row, : len(ids)] = torch.tensor(ids)
        attention_BT[row, : len(ids)] = 1
        learn_BT[row, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
    inputs = {"input_ids": input_ids_BT.to(device), "attention_mask": attention_BT.to(device), "use_cache": False}
    predicts_BT = learn_BT[:, 1:].to(device)  # the outputs at positions 0..T-2 that predict a learned token
    targets_N = input_ids_BT[:, 1:].to(device)[predicts_BT]
    if head is not None:
        hidden_BTH = model.get_decoder()(**inputs).last_hidden_state[:, :-1]
        logp_N, _ = token_logprobs(
            hidden_BTH[predicts_BT], head.weight, targets_N, torch.ones(len(targets_N), device=device)
        )
    else:  # an output layer with bias, scaling or soft-capping: the model's own logits
        logits_BTV = model(**inputs).logits[:, :-1].float()
        logp_N = torch.log_softmax(logits_BTV[predicts_BT], dim=-1).gather(-1, targets_N[:, None])[:, 0]
    loss = -logp_N.sum() / total_tokens
    loss.backward()
    return float(loss.detach())


class SFTStage:
    """SFT steps over a task's demonstrations: their seeded cursor, their optimizer, one step at a time.

    ``algo=sft`` runs only this stage; ``algo=grpo`` runs it first as a warm-up (``algo.warmup``).
    ``sft_cfg`` holds split, steps, epochs, batch_size, micro_batch_size, lr, weight_decay,
    max_grad_norm and max_length (conf/algo/sft.yaml, or grpo.yaml's ``warmup``); the task, its prompt
    and the seed are the runtime's.
    """

    def __init__(self, rt: Runtime, sft_cfg: SFTConfig):
        sft_cfg = typed(SFTConfig, sft_cfg)
        task = rt.task_config
        self.rt, self.sft_cfg = rt, sft_cfg
        if rt.task.demonstrations is None:
            raise ConfigError(f"task '{task.name}' has no demonstrations (task.demonstrations) for SFT")
        template = rt.task.resources_for(task.prompt)["prompt_template"]
        self.demos = rt.task.demonstrations(sft_cfg.split, prompt_template=template, **rt.task.resources)
        if not self.demos:
            raise ConfigError(f"task '{task.name}' has no demonstrations for split '{sft_cfg.split}'")
        self.steps = sft_cfg.steps
        if sft_cfg.epochs:
            self.steps = math.ceil(sft_cfg.epochs * len(self.demos) / sft_cfg.batch_size)
        self.seed = rt.seed
        self.cursor = TaskCursor(len(self.demos), rt.seed)
        self.optimizer = torch.optim.AdamW(
            rt.policy.trainable_parameters(), lr=sft_cfg.lr, weight_decay=sft_cfg.weight_decay
        )
        self._rendered: dict[int, tuple[list[int], list[int]]] = {}

    def example(self, index: int) -> tuple[list[int], list[int]]:
        if index not in self._rendered:  # rendered on first use: a big split costs nothing up front
            self._rendered[index] = render_demonstration(self.rt.policy, self.demos[index], self.sft_cfg.max_length)
        return self._rendered[index]

    def restore_cursor(self, state: dict) -> None:
        self.cursor = TaskCursor(len(self.demos), self.seed, **state)

    async def train_step(self, step: int) -> dict:
        rt, sft_cfg = self.rt, self.sft_cfg
        started = time.perf_counter()
        examples = [self.example(i) for i in self.cursor.take(sft_cfg.batch_size)]

        def update() -> dict:
            with update_memory():  # small blocks mapped, heaps trimmed after (agl/memory.py)
                rt.policy.model.train()
                self.optimizer.zero_grad(set_to_none=True)
                stats = sft_loss_and_backward(
                    rt.policy,
                    examples,
                    sft_cfg.micro_batch_size,
                    sft_cfg.micro_batch_tokens,
                    sft_cfg.gradient_checkpointing,
                )
                grad_norm = float(
                    torch.nn.utils.clip_grad_norm_(rt.policy.trainable_parameters(), sft_cfg.max_grad_norm)
                )
                self.optimizer.step()
                rt.policy.model.eval()
            return {**stats, "grad_norm": grad_norm}

        async with rt.engine.paused():  # no forward pass may run while weights change
            stats = await compute_thread.run(update)
            rt.policy.version += 1
        return {
            "step": step,
            "policy_version": rt.policy.version,
            **stats,
            "lr": float(sft_cfg.lr),
            "examples": len(examples),
            "seq_len_mean": sum(len(ids) for ids, _ in examples) / len(examples),
            "time_update_s": time.perf_counter() - started,
            **device_memory(rt.policy.device),  # peak_vram_mib on CUDA
        }


class SFTTrainer:
    """``algo=sft``: the SFT stage alone, with evals, checkpoints and the final adapter."""

    def __init__(self, rt: Runtime, algo: SFTConfig):
        self.rt, self.algo = rt, typed(SFTConfig, algo)
        task = rt.task_config
        self.run_dir = rt.run_dir
        self.stage = SFTStage(rt, self.algo)
        self.steps = self.stage.steps
        eval_rows = rt.task.load(task.eval_split) if self.algo.eval else []
        self.eval_rows = eval_rows[: task.eval_size] if task.eval_size else eval_rows
        self.step = 0

    async def restore(self) -> bool:
        checkpoint = await resume_or_start(self.rt, lambda state: self.stage.optimizer)
        if checkpoint is None:
            return False
        self.stage.restore_cursor(checkpoint.state["cursor"])
        self.step = checkpoint.step + 1
        return True

    async def _plan(self, fresh: bool) -> JobPlan:
        """This job's remaining phases with their estimates, from rates measured now; printed (agl/train/plan.py)."""
        rt, sft_cfg, tokens = self.rt, self.algo, self.algo.max_tokens
        demos = [self.stage.example(i) for i in range(min(16, len(self.stage.demos)))]
        mean_length = sum(len(ids) for ids, _ in demos) / len(demos)
        prompt_ids = probe_prompt(rt, self.eval_rows, rt.task_config.prompt)
        backward = functools.partial(sft_loss_and_backward, gradient_checkpointing=sft_cfg.gradient_checkpointing)
        rates = await measure_rates(rt, prompt_ids, rt.runner_config.n or 1, tokens, int(mean_length), backward)
        n, p, left = len(self.eval_rows), len(prompt_ids), self.steps - self.step
        evals = sum(self._due(s) for s in range(self.step + 1, self.steps + 1)) if n else 0
        step_s = sft_cfg.batch_size * mean_length * rates.train_s_per_token
        plan = JobPlan(
            [
                Phase("baseline eval", f"{n} problems", rates.eval_s(n, p, tokens), units=int(fresh and n > 0)),
                Phase("SFT", f"{left} steps x {sft_cfg.batch_size} demonstrations", left * step_s, units=left),
                Phase("evals", f"{evals} x {n} problems", evals * rates.eval_s(n, p, tokens), units=evals),
            ],
            rates,
        )
        plan.announce()
        return plan

    def _due(self, done: int) -> bool:
        every = self.algo.eval_every
        return done == self.steps or bool(every and done % every == 0)

    async def train(self) -> dict:
        resumed = await self.restore()
        plan = await self._plan(fresh=not resumed)
        if not resumed and self.eval_rows:
            plan.begin("baseline eval")
            await log_baseline(self.rt, await eval_during_training(self.rt, self.eval_rows, 0, self.algo.max_tokens))
            plan.tick("baseline eval")
        with tqdm(
            total=self.steps, initial=self.step, desc="sft", dynamic_ncols=True, disable=not self.rt.progress
        ) as bar:
            while self.step < self.steps:
                plan.begin("SFT")
                metrics = await self.stage.train_step(self.step)
                plan.tick("SFT")
                done = self.step + 1
                if self.eval_rows and self._due(done):
                    plan.begin("evals")
                    metrics.update(await eval_during_training(self.rt, self.eval_rows, done, self.algo.max_tokens))
                    plan.tick("evals")
                await save_checkpoint(
                    self.rt, self.step, {"cursor": self.stage.cursor.state()}, self.stage.optimizer, metrics
                )
                append_metrics(self.run_dir, metrics)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")
                bar.update(1)
                self.step += 1
        final_dir = self.run_dir / "adapter"
        await compute_thread.run(self.rt.policy.save_adapter, final_dir)
        draw_curves(self.run_dir)
        path = metrics_path(self.run_dir)
        last = json.loads(path.read_text().splitlines()[-1]) if path.is_file() else {}
        return {
            "resumed": resumed,
            "steps": self.step,
            "adapter": str(final_dir),
            "metrics": {k: v for k, v in last.items() if k != "step"},
        }
