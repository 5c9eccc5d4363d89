"""GRPO on the LoRA: from scored samples to one optimizer step.

``GRPOUpdate.step(samples, advantages)`` is one update: the step's micro-batches
(``agl.train.micro_batches.StepBatches``), their old and reference log-probs when asked for,
then forward, the loss (``agl.train.loss``, by name) and backward per micro-batch, one optimizer
step, and the step's metrics. Advantages come from ``agl.train.advantages``.

Left out on purpose: a value model (GRPO has none), and entropy bonuses (rarely help with
LoRA at this scale; entropy is logged so collapse is visible).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch

from agl.config import GRPOConfig
from agl.memory import update_memory
from agl.policy.load import Policy
from agl.train.activation_checkpointing import checkpointed_layers
from agl.train.advantages import ESTIMATORS
from agl.train.loss import LossInputs, micro_batch_loss, resolve_loss
from agl.train.merged_lora import dequantized_4bit_layers, merged_lora_layers
from agl.train.micro_batches import MicroBatch, StepBatches
from agl.train.samples import Sample


def check_update(config: GRPOConfig) -> None:
    """Resolve ``algo.loss`` and ``algo.advantage`` (a ConfigError if either names nothing, or a loss parameter
    is wrong), as the update will."""
    resolve_loss(config.loss)
    ESTIMATORS.get(config.advantage)


class GRPOUpdate:
    """Owns the optimizer; ``step(samples, advantages)`` is one policy update."""

    def __init__(self, policy: Policy, config: GRPOConfig):
        self.policy = policy
        self.config = config
        self.loss, self.loss_params = resolve_loss(config.loss)
        self.optimizer = torch.optim.AdamW(
            policy.trainable_parameters(), lr=config.lr, weight_decay=config.weight_decay
        )

    def step(self, samples: Sequence[Sample], advs: Sequence[float]) -> dict[str, float]:
        # small blocks mapped, heaps trimmed after (agl/memory.py); LoRA layers as one matmul each, or
        # their 4-bit base weights dequantized once for the step (agl/train/merged_lora.py)
        policy = self.policy
        with (
            update_memory(),
            merged_lora_layers(policy.model, policy.train_merged),
            dequantized_4bit_layers(policy.model, policy.keeps_dequantized),
        ):
            return self._step(samples, advs)

    def _step(self, samples: Sequence[Sample], advs: Sequence[float]) -> dict[str, float]:
        cfg, policy = self.config, self.policy
        batches = StepBatches(
            samples,
            advs,
            policy,
            weighting=self.loss.weighting,
            size=cfg.micro_batch_size,
            tokens=cfg.micro_batch_tokens,
            mask_truncated=cfg.mask_truncated,
        )
        timings: dict[str, float] = defaultdict(float)
        if batches.grammar_replay_s:
            timings["grammar_replay_s"] = batches.grammar_replay_s
        if cfg.old_logprobs == "recompute":  # else the sampler's, recorded in the spans
            with timed(timings, "old_logprob_s"):
                for mb, old_logp_BT in zip(batches, batches.logprobs(policy)):
                    mb.batch.old_logp_BT = old_logp_BT
        if cfg.beta:
            with timed(timings, "ref_s"), policy.reference():
                for mb, ref_logp_BT in zip(batches, batches.logprobs(policy)):
                    mb.ref_logp_BT = ref_logp_BT

        metrics = StepMetrics()
        grad_norm = 0.0
        # activations of one layer at a time (agl/train/activation_checkpointing.py)
        with training(policy), checkpointed_layers(policy.model, cfg.gradient_checkpointing):
            for _ in range(cfg.num_iterations):
                self.optimizer.zero_grad(set_to_none=True)
                passes = batches.passes(policy, with_entropy=True, backward=True, timings=timings)
                for mb, logp_BT, entropy_BT in passes:
                    x = LossInputs.of(logp_BT, mb.batch.old_logp_BT, mb.advantages_B, mb.batch.mask_BT)
                    loss, stats = micro_batch_loss(
                        self.loss, self.loss_params, x, mb.weights_BT, cfg.beta, mb.ref_logp_BT
                    )
                    with timed(timings, "backward_s"):
                        loss.backward()
                    metrics.add(mb, loss, stats, logp_BT, entropy_BT)
                with timed(timings, "optimizer_s"):
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), cfg.max_grad_norm))
                    self.optimizer.step()
        return metrics.result(cfg.num_iterations, grad_norm) | timings


class StepMetrics:
    """Sums over a step's micro-batches (and its ``num_iterations`` passes), then per token or per pass."""

    PER_TOKEN = ("clip_ratio_low", "clip_ratio_high", "kl", "ratio_mean", "entropy", "logprob_diff_abs")

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(
        self,
        mb: MicroBatch,
        loss: torch.Tensor,
        stats: dict[str, torch.Tensor],
        logp_BT: torch.Tensor,
        entropy_BT: torch.Tensor | None,
    ) -> None:
        sums, mask_BT = self.sums, mb.batch.mask_BT
        n = float(stats["tokens"])
        sums["tokens"] += n
        sums["input_tokens"] += mb.input_tokens
        sums["loss"] += float(loss.detach())
        for key in ("clip_ratio_low", "clip_ratio_high", "kl", "ratio_mean"):
            sums[key] += float(stats[key]) * n
        sums["entropy"] += float((entropy_BT * mask_BT).sum())
        sums["logprob_diff_abs"] += float(((logp_BT.detach() - mb.batch.old_logp_BT).abs() * mask_BT).sum())
        if mb.batch.grammar_index_BT is not None:  # sampled tokens whose distribution a grammar masked
            sums["constrained_tokens"] += float(((mb.batch.grammar_index_BT >= 0) * mask_BT).sum())

    def result(self, iterations: int, grad_norm: float) -> dict[str, float]:
        sums = self.sums
        n_tokens = max(sums["tokens"], 1.0)
        return {
            "loss": sums["loss"] / iterations,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            "train_tokens": sums["tokens"] / iterations,
            "train_input_tokens": sums["input_tokens"] / iterations,  # tokens run through the model
            "constrained_tokens": sums["constrained_tokens"] / iterations,
            **{key: sums[key] / n_tokens for key in self.PER_TOKEN},
        }


@contextlib.contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[key] += time.perf_counter() - start


@contextlib.contextmanager
def training(policy: Policy) -> Iterator[None]:
    """The model in train mode for the update, back in eval mode for serving after."""
    policy.model.train()
    try:
        yield
    finally:
        policy.model.eval()
