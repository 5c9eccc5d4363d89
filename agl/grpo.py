"""GRPO on the LoRA: from scored samples to one optimizer step.

``advantages`` turns rewards into per-sample advantages group by group; ``GRPOUpdate`` runs
the forward/backward passes in micro-batches and steps the optimizer. The loss itself is in
``agl.loss`` (pure tensors); this module only batches tokens and accumulates gradients.

Left out on purpose: a value model (GRPO has none), and entropy bonuses (rarely help with
LoRA at this scale; entropy is logged so collapse is visible).
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from typing import Any, Sequence

import torch

from agl.adapter import Sample
from agl.logprobs import token_logprobs
from agl.loss import group_advantages, policy_loss, token_weights
from agl.model import Policy


@dataclasses.dataclass
class GRPOConfig:
    lr: float = 1e-4
    loss_type: str = "grpo"
    scale_rewards: str = "group"  # group | batch | none
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0  # KL weight against the adapter-disabled base model
    num_iterations: int = 1  # mu: optimizer passes over each batch
    micro_batch_size: int = 8
    max_grad_norm: float = 1.0
    mask_truncated: bool = False  # drop completions cut off by max_tokens from the loss
    drop_zero_std: bool = True  # groups whose rewards are all equal teach nothing
    weight_decay: float = 0.0
    old_logprobs: str = "recorded"  # recorded (from spans) | recompute (trainer forward before step)
    # Coefficients of single loss types (see agl.loss); conf/algo/grpo.yaml has the same defaults.
    opmd_tau: float = 1.0  # opmd: the loss is divided by 1 + tau (Trinity-RFT's default)
    sapo_tau_pos: float = 1.0  # sapo: gate temperature where the advantage is > 0 (SAPO paper, TRL)
    sapo_tau_neg: float = 1.05  # sapo: gate temperature where it is <= 0

    @classmethod
    def from_cfg(cls, cfg: Any) -> "GRPOConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(cfg).items() if k in names})


def advantages(samples: Sequence[Sample], scale: str, drop_zero_std: bool) -> tuple[list[Sample], list[float], dict]:
    """Per-sample advantages, comparing each rollout with the others of its group.

    A group where every rollout got the same reward has zero advantage everywhere, so it is
    skipped (``drop_zero_std``): it would only add forward/backward cost and dilute the mean.
    """
    by_group: dict[Any, list[Sample]] = defaultdict(list)
    for sample in samples:
        by_group[sample.group].append(sample)
    all_rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    batch_std = float(all_rewards.std()) if len(samples) > 1 else 0.0
    kept, advs, zero_std = [], [], 0
    for group in by_group.values():
        # one reward per rollout: a merged multi-turn rollout may still give several samples
        per_rollout = {s.rollout_id: s.reward for s in group}
        rewards_G = torch.tensor(list(per_rollout.values()), dtype=torch.float32)
        if len(rewards_G) < 2 or float(rewards_G.std()) == 0.0:
            zero_std += 1
            if drop_zero_std:
                continue
        if len(rewards_G) < 2:
            adv_by_rollout = {rid: 0.0 for rid in per_rollout}
        else:
            adv_G = group_advantages(rewards_G, scale, batch_std=batch_std)
            adv_by_rollout = dict(zip(per_rollout, adv_G.tolist()))
        for sample in group:
            kept.append(sample)
            advs.append(adv_by_rollout[sample.rollout_id])
    stats = {"frac_reward_zero_std": zero_std / max(len(by_group), 1), "groups": len(by_group)}
    return kept, advs, stats


@dataclasses.dataclass
class TokenBatch:
    """Samples laid out for one forward pass; every tensor is aligned on the completion.

    Two layouts:
      - shared prompt (a GRPO group): the prompt is run once, its KV cache is expanded to
        every row, and only the completions are run per row. For G=8 samples of a 150-token
        prompt and 128-token completions that is ~1,200 tokens instead of ~2,200.
      - padded: prompts left-padded, completions right-padded, one pass:
        [pad pad p p p | c c c pad], so ``logits_to_keep`` skips the prompt's vocab projection.
    """

    completion_BT: torch.Tensor  # completion token ids (right-padded)
    completion_attention_BT: torch.Tensor  # 1 on real completion tokens
    mask_BT: torch.Tensor  # float, 1 where the loss applies
    old_logp_BT: torch.Tensor
    temperature_B: torch.Tensor
    shared_prompt: list[int] | None = None  # set: the shared-prompt layout
    input_ids_BL: torch.Tensor | None = None  # padded layout only
    attention_mask_BL: torch.Tensor | None = None

    @classmethod
    def build(cls, samples: Sequence[Sample], pad_id: int, mask_truncated: bool, share_prompt: bool = True) -> "TokenBatch":
        B, t_max = len(samples), max(len(s.completion_ids) for s in samples)
        completion = torch.full((B, t_max), pad_id, dtype=torch.long)
        completion_attention = torch.zeros((B, t_max), dtype=torch.long)
        mask = torch.zeros((B, t_max))
        old_logp = torch.zeros((B, t_max))
        for i, s in enumerate(samples):
            t = len(s.completion_ids)
            completion[i, :t] = torch.tensor(s.completion_ids)
            completion_attention[i, :t] = 1
            if not (mask_truncated and s.truncated):
                mask[i, :t] = torch.tensor(s.mask, dtype=torch.float32)
            old_logp[i, :t] = torch.tensor(s.logprobs, dtype=torch.float32)
        temperature = torch.tensor([s.temperature for s in samples], dtype=torch.float32)
        batch = cls(completion, completion_attention, mask, old_logp, temperature)
        if share_prompt and B > 1 and all(s.prompt_ids == samples[0].prompt_ids for s in samples):
            batch.shared_prompt = list(samples[0].prompt_ids)
            return batch
        p_max = max(len(s.prompt_ids) for s in samples)
        batch.input_ids_BL = torch.full((B, p_max + t_max), pad_id, dtype=torch.long)
        batch.attention_mask_BL = torch.zeros((B, p_max + t_max), dtype=torch.long)
        for i, s in enumerate(samples):
            p = len(s.prompt_ids)
            batch.input_ids_BL[i, p_max - p : p_max] = torch.tensor(s.prompt_ids)
            batch.input_ids_BL[i, p_max:] = completion[i]
            batch.attention_mask_BL[i, p_max - p : p_max] = 1
            batch.attention_mask_BL[i, p_max:] = completion_attention[i]
        return batch


    @property
    def num_input_tokens(self) -> int:
        """Tokens the forward pass runs (a shared prompt once), padding excluded."""
        completion = int(self.completion_attention_BT.sum())
        if self.shared_prompt is not None:
            return len(self.shared_prompt) + completion
        return int(self.attention_mask_BL.sum())


def plan_micro_batches(samples: Sequence[Sample], size: int) -> list[list[int]]:
    """Indices per micro-batch: samples sharing a prompt together (their prompt runs once),
    the rest length-sorted so padding wastes little."""
    by_prompt: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_prompt[tuple(sample.prompt_ids)].append(i)
    shared = [idx for idx in by_prompt.values() if len(idx) > 1]
    singles = sorted((idx[0] for idx in by_prompt.values() if len(idx) == 1), key=lambda i: len(samples[i].prompt_ids) + len(samples[i].completion_ids))
    plan = [idx[i : i + size] for idx in shared for i in range(0, len(idx), size)]
    return plan + [singles[i : i + size] for i in range(0, len(singles), size)]


def _forward(policy: Policy, batch: TokenBatch, decoder_only: bool) -> torch.Tensor:
    """Per completion position, the model output that predicts that token. [B, T, H or V]

    ``decoder_only``: the final hidden states (the vocabulary projection is left to
    ``token_logprobs``); otherwise the full model's logits.
    """
    device = policy.device
    model = policy.model.get_base_model()

    def run(keep: int = 0, **inputs: Any) -> tuple[torch.Tensor, Any]:
        """(the outputs, the model's return value); logits only for the last ``keep`` positions (0: all)."""
        if decoder_only:
            out = model.get_decoder()(**inputs)
            return out.last_hidden_state, out
        out = model(**inputs, logits_to_keep=keep)
        return out.logits, out

    T = batch.completion_BT.shape[1]
    if batch.shared_prompt is None:
        attention = batch.attention_mask_BL.to(device)
        outputs, _ = run(
            T + 1,  # the output at position t predicts token t+1
            input_ids=batch.input_ids_BL.to(device),
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        )
        return outputs[:, -T - 1 : -1]
    B, P = batch.completion_BT.shape[0], len(batch.shared_prompt)
    prompt_outputs, prompt = run(1, input_ids=torch.tensor([batch.shared_prompt], device=device), use_cache=True)
    cache = prompt.past_key_values
    for layer in cache.layers:  # one prompt KV for every row; gradients from all rows sum into it
        layer.keys, layer.values = layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1)
    attention = torch.cat([torch.ones((B, P), dtype=torch.long), batch.completion_attention_BT], dim=1).to(device)
    outputs, _ = run(
        input_ids=batch.completion_BT.to(device),
        attention_mask=attention,
        position_ids=torch.arange(P, P + T, device=device).expand(B, -1),
        past_key_values=cache,
        use_cache=True,
    )
    first = prompt_outputs[:, -1:].expand(B, -1, -1)  # the prompt's last output predicts token 0
    return torch.cat([first, outputs[:, :-1]], dim=1)


def fused_head(policy: Policy) -> torch.nn.Linear | None:
    """The output layer, when logits are exactly ``h @ W.T`` (no bias, soft-capping or scaling),
    so ``token_logprobs`` may compute them; else None and the model computes its own logits."""
    model = policy.model.get_base_model()
    head = model.get_output_embeddings()
    config = model.config
    plain = type(head) is torch.nn.Linear and head.bias is None
    rescaled = any(getattr(config, name, None) not in (None, 1.0) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    return head if plain and not rescaled else None


def completion_logprobs(policy: Policy, batch: TokenBatch, with_entropy: bool = False, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens under the policy, at each sample's temperature. [B, T]

    With ``with_entropy``, also each position's entropy (detached). [B, T]
    ``fused=False`` forces the model's own logits (the path for output layers ``fused_head`` rejects).
    """
    device = policy.device
    tokens_BT = batch.completion_BT.to(device)
    B, T = tokens_BT.shape
    temperature_BT = batch.temperature_B.to(device)[:, None].expand(B, T)
    head = fused_head(policy) if fused else None
    if head is not None:
        hidden_BTH = _forward(policy, batch, decoder_only=True)
        real_BT = batch.completion_attention_BT.to(device).bool()  # padding needs no vocabulary projection
        logp_N, entropy_N = token_logprobs(hidden_BTH[real_BT], head.weight, tokens_BT[real_BT], temperature_BT[real_BT])
        logp_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, logp_N)
        entropy_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, entropy_N) if with_entropy else None
    else:
        logits_BTV = _forward(policy, batch, decoder_only=False).float() / temperature_BT[..., None]
        logp_BT = logits_BTV.gather(-1, tokens_BT[..., None])[..., 0] - torch.logsumexp(logits_BTV, dim=-1)
        entropy_BT = None
        if with_entropy:
            with torch.no_grad():
                log_probs = torch.log_softmax(logits_BTV, dim=-1)
                entropy_BT = -(log_probs.exp() * log_probs).sum(-1)
    return logp_BT.cpu(), (entropy_BT.detach().cpu() if entropy_BT is not None else None)


class GRPOUpdate:
    """Owns the optimizer; ``step(samples, advantages)`` is one policy update."""

    def __init__(self, policy: Policy, config: GRPOConfig):
        self.policy = policy
        self.config = config
        self.optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def step(self, samples: Sequence[Sample], advs: Sequence[float]) -> dict[str, float]:
        cfg = self.config
        policy = self.policy
        pad_id = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else policy.eos_token_ids[0]
        chunks = plan_micro_batches(samples, cfg.micro_batch_size)
        batches = [TokenBatch.build([samples[i] for i in chunk], pad_id, cfg.mask_truncated) for chunk in chunks]
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

        timings = defaultdict(float)
        if cfg.old_logprobs == "recompute":
            start = time.perf_counter()
            with torch.no_grad():
                for b in batches:
                    b.old_logp_BT = completion_logprobs(policy, b)[0].detach()
            timings["old_logprob_s"] += time.perf_counter() - start
        refs: list[torch.Tensor | None] = [None] * len(batches)
        if cfg.beta:
            start = time.perf_counter()
            with torch.no_grad(), policy.reference():
                refs = [completion_logprobs(policy, b)[0].detach() for b in batches]
            timings["ref_s"] += time.perf_counter() - start

        policy.model.train()
        sums: dict[str, float] = defaultdict(float)
        grad_norm = 0.0
        for _ in range(cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for b, adv_B, w_BT, ref_BT in zip(batches, adv_chunks, weights, refs):
                start = time.perf_counter()
                logp_BT, entropy_BT = completion_logprobs(policy, b, with_entropy=True)
                loss, stats = policy_loss(
                    logp_BT, b.old_logp_BT, adv_B, b.mask_BT, w_BT,
                    loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                    beta=cfg.beta, ref_logp_BT=ref_BT,
                    sapo_tau_pos=cfg.sapo_tau_pos, sapo_tau_neg=cfg.sapo_tau_neg, opmd_tau=cfg.opmd_tau,
                )
                timings["forward_s"] += time.perf_counter() - start
                start = time.perf_counter()
                loss.backward()
                timings["backward_s"] += time.perf_counter() - start
                n = float(stats["tokens"])
                sums["tokens"] += n
                sums["input_tokens"] += b.num_input_tokens
                sums["loss"] += float(loss.detach())
                for key in ("clip_ratio_low", "clip_ratio_high", "kl", "ratio_mean"):
                    sums[key] += float(stats[key]) * n
                sums["entropy"] += float((entropy_BT * b.mask_BT).sum())
                sums["logprob_diff_abs"] += float(((logp_BT.detach() - b.old_logp_BT).abs() * b.mask_BT).sum())
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
            **{k: sums[k] / n_tokens for k in ("clip_ratio_low", "clip_ratio_high", "kl", "ratio_mean", "entropy", "logprob_diff_abs")},
            **timings,
        }
        return metrics
