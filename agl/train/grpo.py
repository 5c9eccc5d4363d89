"""GRPO on the LoRA: from scored samples to one optimizer step.

``advantages`` turns rewards into per-sample advantages group by group; ``GRPOUpdate`` runs
the forward/backward passes in micro-batches and steps the optimizer. The loss itself is in
``agl.train.loss`` (pure tensors); this module only batches tokens and accumulates gradients.

Samples sampled under a grammar (structured outputs, agl.route.structure) have their masks rebuilt
here, by replaying the grammar over the recorded tokens (``grammar_masks``): the update's log-probs
at those positions are the masked distribution's, as the sampler's were, so the importance ratios
compare like with like. Forced positions already carry no loss (agl.train.samples).

Left out on purpose: a value model (GRPO has none), and entropy bonuses (rarely help with
LoRA at this scale; entropy is logged so collapse is visible)."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from agl.config import GRPOConfig
from agl.memory import update_memory
from agl.policy.grammar import policy_grammar_tokenizer, replay
from agl.policy.load import Policy
from agl.train.activation_checkpointing import checkpointed_layers
from agl.train.forward import SharedPrompt, completion_logprobs, uses_hidden_states
from agl.train.loss import group_advantages, policy_loss, token_weights
from agl.train.merged_lora import merged_lora_layers
from agl.train.micro_batches import TokenBatch, plan_micro_batches
from agl.train.samples import Sample


def advantages(samples: Sequence[Sample], scale: str) -> tuple[list[float], set[Any]]:
    """Each sample's advantage, comparing its rollout with the others of its group, and the flat
    groups: those whose rollouts all got the same reward (or that have one rollout), where every
    advantage is zero."""
    by_group: dict[Any, dict[str, float]] = defaultdict(dict)
    for sample in samples:  # one reward per rollout: a merged multi-turn rollout may still give several samples
        by_group[sample.group][sample.rollout_id] = sample.reward
    all_rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    batch_std = float(all_rewards.std()) if len(samples) > 1 else 0.0
    adv_by_rollout: dict[str, float] = {}
    flat = set()
    for group, per_rollout in by_group.items():
        rewards_G = torch.tensor(list(per_rollout.values()), dtype=torch.float32)
        if len(rewards_G) < 2 or float(rewards_G.std()) == 0.0:
            flat.add(group)
            adv_by_rollout.update(dict.fromkeys(per_rollout, 0.0))
        else:
            adv_by_rollout.update(zip(per_rollout, group_advantages(rewards_G, scale, batch_std=batch_std).tolist()))
    return [adv_by_rollout[s.rollout_id] for s in samples], flat


def grammar_masks(samples: Sequence[Sample], policy: Policy) -> list[list[tuple[int, torch.Tensor]]]:
    """Per sample, (start, bitmask [L, W]) for each of its grammar-sampled spans: the masks the
    sampler used, rebuilt by replaying each grammar over the recorded tokens (agl.policy.grammar.replay)."""
    if not any(s.constraints for s in samples):
        return [[] for _ in samples]
    tokenizer = policy_grammar_tokenizer(policy)
    return [
        [(c.start, replay(c.grammar, s.completion_ids[c.start : c.start + c.length], tokenizer)) for c in s.constraints]
        for s in samples
    ]


def drop_groups(samples: Sequence[Sample], advs: Sequence[float], groups: set[Any]) -> tuple[list[Sample], list[float]]:
    """The samples outside ``groups``, with their advantages. For the flat groups (``drop_zero_std``):
    all-zero advantages teach nothing, they would only add forward/backward cost and dilute the mean."""
    pairs = [(sample, adv) for sample, adv in zip(samples, advs) if sample.group not in groups]
    return [sample for sample, _ in pairs], [adv for _, adv in pairs]


class GRPOUpdate:
    """Owns the optimizer; ``step(samples, advantages)`` is one policy update."""

    def __init__(self, policy: Policy, config: GRPOConfig):
        self.policy = policy
        self.config = config
        self.optimizer = torch.optim.AdamW(
            policy.trainable_parameters(), lr=config.lr, weight_decay=config.weight_decay
        )

    def step(self, samples: Sequence[Sample], advs: Sequence[float]) -> dict[str, float]:
        # small blocks mapped, heaps trimmed after (agl/memory.py);
        # LoRA layers as one matmul each (agl/train/merged_lora.py)
        with update_memory(), merged_lora_layers(self.policy.model, self.policy.train_merged):
            return self._step(samples, advs)

    def _step(self, samples: Sequence[Sample], advs: Sequence[float]) -> dict[str, float]:
        cfg = self.config
        policy = self.policy
        pad_id = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else policy.eos_token_ids[0]
        chunks = plan_micro_batches(samples, cfg.micro_batch_size, cfg.micro_batch_tokens)
        # A group cut into several micro-batches runs its prompt once for all of them (SharedPrompt):
        # parts[i] says which cut group micro-batch i belongs to (None: a group or singles whole).
        prompts = [tuple(samples[chunk[0]].prompt_ids) for chunk in chunks]
        cuts = Counter(p for p, chunk in zip(prompts, chunks) if all(tuple(samples[i].prompt_ids) == p for i in chunk))
        parts = [p if cuts[p] > 1 else None for p in prompts]
        start = time.perf_counter()
        masks = grammar_masks(samples, policy)
        replay_s = time.perf_counter() - start
        batches = [
            TokenBatch.build(
                [samples[i] for i in chunk],
                pad_id,
                cfg.mask_truncated,
                min_shared_rows=1 if part else 2,
                grammar_masks=[masks[i] for i in chunk],
            )
            for chunk, part in zip(chunks, parts)
        ]
        first = [part is not None and (i == 0 or parts[i - 1] != part) for i, part in enumerate(parts)]
        last = [part is not None and (i + 1 == len(parts) or parts[i + 1] != part) for i, part in enumerate(parts)]
        adv_chunks = [torch.tensor([advs[i] for i in chunk], dtype=torch.float32) for chunk in chunks]
        max_len = max(b.mask_BT.shape[1] for b in batches)
        # Weights over the whole step, so accumulation over micro-batches equals one big batch.
        all_mask = torch.zeros((len(samples), max_len))
        row = 0
        for b in batches:
            all_mask[row : row + len(b.mask_BT), : b.mask_BT.shape[1]] = b.mask_BT
            row += len(b.mask_BT)
        all_weights = token_weights(all_mask, cfg.loss_type, max_len)
        weights, row = [], 0
        for b in batches:
            weights.append(all_weights[row : row + len(b.mask_BT), : b.mask_BT.shape[1]])
            row += len(b.mask_BT)
        hidden = uses_hidden_states(policy)

        def no_grad_logprobs() -> list[torch.Tensor]:
            out, prompt = [], None
            with torch.no_grad():
                for i, b in enumerate(batches):
                    if first[i]:
                        prompt = SharedPrompt(policy, b.shared_prompt, hidden)
                    out.append(completion_logprobs(policy, b, prompt=prompt if parts[i] else None)[0].detach())
            return out

        timings = defaultdict(float)
        if replay_s and any(s.constraints for s in samples):
            timings["grammar_replay_s"] = replay_s
        if cfg.old_logprobs == "recompute":
            start = time.perf_counter()
            for b, old_logp_BT in zip(batches, no_grad_logprobs()):
                b.old_logp_BT = old_logp_BT
            timings["old_logprob_s"] += time.perf_counter() - start
        refs: list[torch.Tensor | None] = [None] * len(batches)
        if cfg.beta:
            start = time.perf_counter()
            with policy.reference():
                refs = no_grad_logprobs()
            timings["ref_s"] += time.perf_counter() - start

        policy.model.train()
        sums: dict[str, float] = defaultdict(float)
        grad_norm = 0.0
        with checkpointed_layers(
            policy.model, cfg.gradient_checkpointing
        ):  # activations of one layer at a time (agl/train/activation_checkpointing.py)
            for _ in range(cfg.num_iterations):
                self.optimizer.zero_grad(set_to_none=True)
                prompt = None
                for i, (b, adv_B, w_BT, ref_BT) in enumerate(zip(batches, adv_chunks, weights, refs)):
                    start = time.perf_counter()
                    if first[i]:
                        prompt = SharedPrompt(policy, b.shared_prompt, hidden)
                    logp_BT, entropy_BT = completion_logprobs(
                        policy, b, with_entropy=True, prompt=prompt if parts[i] else None
                    )
                    loss, stats = policy_loss(
                        logp_BT,
                        b.old_logp_BT,
                        adv_B,
                        b.mask_BT,
                        w_BT,
                        loss_type=cfg.loss_type,
                        epsilon=cfg.epsilon,
                        epsilon_high=cfg.epsilon_high,
                        beta=cfg.beta,
                        ref_logp_BT=ref_BT,
                        sapo_tau_pos=cfg.sapo_tau_pos,
                        sapo_tau_neg=cfg.sapo_tau_neg,
                        opmd_tau=cfg.opmd_tau,
                    )
                    timings["forward_s"] += time.perf_counter() - start
                    start = time.perf_counter()
                    loss.backward()
                    if last[i]:  # the group's last micro-batch: now the prompt's backward, once
                        prompt.backward()
                        prompt = None
                    timings["backward_s"] += time.perf_counter() - start
                    n = float(stats["tokens"])
                    sums["tokens"] += n
                    sums["input_tokens"] += b.num_input_tokens - (
                        len(b.shared_prompt) if parts[i] and not first[i] else 0
                    )
                    sums["loss"] += float(loss.detach())
                    for key in ("clip_ratio_low", "clip_ratio_high", "kl", "ratio_mean"):
                        sums[key] += float(stats[key]) * n
                    sums["entropy"] += float((entropy_BT * b.mask_BT).sum())
                    sums["logprob_diff_abs"] += float(((logp_BT.detach() - b.old_logp_BT).abs() * b.mask_BT).sum())
                    if b.grammar_index_BT is not None:  # sampled tokens whose distribution a grammar masked
                        sums["constrained_tokens"] += float(((b.grammar_index_BT >= 0) * b.mask_BT).sum())
                start = time.perf_counter()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), cfg.max_grad_norm))
                self.optimizer.step()
                timings["optimizer_s"] += time.perf_counter() - start
        policy.model.eval()

        n_tokens = max(sums["tokens"], 1.0)
        metrics = {
            "loss": sums["loss"] / cfg.num_iterations,
            "grad_norm": grad_norm if math.isfinite(grad_norm) else float("nan"),
            "train_tokens": sums["tokens"] / cfg.num_iterations,
            "train_input_tokens": sums["input_tokens"] / cfg.num_iterations,  # tokens run through the model
            "constrained_tokens": sums["constrained_tokens"] / cfg.num_iterations,
            **{
                k: sums[k] / n_tokens
                for k in ("clip_ratio_low", "clip_ratio_high", "kl", "ratio_mean", "entropy", "logprob_diff_abs")
            },
            **timings,
        }
        return metrics
