"""GRPO on the LoRA: from scored samples to one optimizer step.

``advantages`` turns rewards into per-sample advantages group by group; ``GRPOUpdate`` runs
the forward/backward passes in micro-batches and steps the optimizer. The loss itself is in
``agl.loss`` (pure tensors); this module only batches tokens and accumulates gradients.

Left out on purpose: a value model (GRPO has none), and entropy bonuses (rarely help with
LoRA at this scale; entropy is logged so collapse is visible).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from agl.adapter import Sample
from agl.checkpointing import checkpointed_layers
from agl.config import GRPOConfig  # noqa: F401 (the typed algo=grpo config lives with the others; its home is agl/config.py)
from agl.logprobs import token_logprobs
from agl.loss import group_advantages, policy_loss, token_weights
from agl.memory import update_memory
from agl.merged_lora import merged_lora_layers
from agl.model import Policy


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


def drop_groups(samples: Sequence[Sample], advs: Sequence[float], groups: set[Any]) -> tuple[list[Sample], list[float]]:
    """The samples outside ``groups``, with their advantages. For the flat groups (``drop_zero_std``):
    all-zero advantages teach nothing, they would only add forward/backward cost and dilute the mean."""
    pairs = [(sample, adv) for sample, adv in zip(samples, advs) if sample.group not in groups]
    return [sample for sample, _ in pairs], [adv for _, adv in pairs]


@dataclasses.dataclass
class TokenBatch:
    """Samples laid out for one forward pass; every tensor is aligned on the completion.

    Two layouts:
      - shared prompt (a GRPO group, or a part of one: ``SharedPrompt``): the prompt is run once,
        its KV cache is expanded to every row, and only the completions are run per row. For G=8 samples of a 150-token
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
    def build(cls, samples: Sequence[Sample], pad_id: int, mask_truncated: bool, share_prompt: bool = True, min_shared_rows: int = 2) -> TokenBatch:
        """The shared-prompt layout when ``share_prompt``, every sample has one prompt and there are
        at least ``min_shared_rows`` rows (1 for a part of a group cut into micro-batches); else padded."""
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
        if share_prompt and B >= min_shared_rows and all(s.prompt_ids == samples[0].prompt_ids for s in samples):
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


# Per micro-batch, a fixed cost in tokens of work (every layer's 4-bit weights dequantized in each
# pass, ~3,000 operator dispatches, the loss): cutting a group to save fewer padded tokens than
# this does not pay. Measured ~60 on SmolLM2-135M: 8 completions of 64 tokens on a 150-token prompt
# in 1, 2, 4 and 8 passes, median of 5 alternated rounds (noisy: single rounds gave -150 to 600).
PASS_OVERHEAD_TOKENS = 64

# Performance (bench/update_tokens.py -> bench/results/update_tokens.md; SmolLM2-135M NF4 + LoRA,
# one GRPO step of 4 GSM8K prompts of 153-168 tokens x 8, shared 2-core CPU, one process, medians
# of per-round ratios over 6 alternated rounds): completions averaging 75 tokens take 0.32x the
# update time of completions averaging 230 (0.38x the real tokens). The planner before (each group
# one micro-batch, padded to its longest completion: 5,620 tokens run for 3,044 real) took 0.50x.
# This planner vs. that one: 0.52x the time on the short step (3,440 tokens run, RSS peak 384 vs
# 1,728 MiB above the start), 0.86x on the long one (8,185 vs 8,836 tokens; 2,869 vs 3,311 MiB).


def plan_micro_batches(samples: Sequence[Sample], size: int | None = None, tokens: int | None = None) -> list[list[int]]:
    """Indices per micro-batch, cut so the passes run few padding tokens; a function of the
    samples' contents, not of their order.

    Samples sharing a prompt form a group, whose prompt runs once (``TokenBatch``'s shared-prompt
    layout) however many micro-batches the group is cut into; the others ("singles") go through
    the padded layout. Each kind is sorted longest first and cut into consecutive runs that
    minimize the tokens run, padding included, plus ``PASS_OVERHEAD_TOKENS`` per micro-batch,
    within two caps: at most ``size`` rows, and at most ``tokens`` tokens, padding included (a
    group's micro-batch: its prompt + rows x its longest completion; singles: rows x (longest
    prompt + longest completion)). A sample over ``tokens`` alone gets a micro-batch of its own.
    ``None``: no cap.

    Groups come first, ordered by prompt, each group's micro-batches next to each other; then the
    singles. Equal lengths are ordered by token ids, then rollout id: only exact duplicates may
    trade places.
    """
    if size is not None and size < 1 or tokens is not None and tokens < 1:
        raise ValueError(f"micro-batch caps must be positive or None (size={size}, tokens={tokens})")
    by_prompt: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_prompt[tuple(sample.prompt_ids)].append(i)

    def longest_first(i: int) -> tuple:
        s = samples[i]
        return (-len(s.prompt_ids) - len(s.completion_ids), s.completion_ids, s.prompt_ids, str(s.rollout_id))

    plan: list[list[int]] = []
    for prompt in sorted(p for p, idx in by_prompt.items() if len(idx) > 1):
        order = sorted(by_prompt[prompt], key=longest_first)
        runs = _cut([0] * len(order), [len(samples[i].completion_ids) for i in order], len(prompt), size, tokens)
        plan += [order[a:b] for a, b in runs]
    singles = sorted((idx[0] for idx in by_prompt.values() if len(idx) == 1), key=longest_first)
    runs = _cut([len(samples[i].prompt_ids) for i in singles], [len(samples[i].completion_ids) for i in singles], 0, size, tokens)
    return plan + [singles[a:b] for a, b in runs]


def _cut(prompts: list[int], completions: list[int], shared: int, size: int | None, tokens: int | None) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) covering every row, with the least total of padded tokens
    (rows x (longest prompt + longest completion)) plus ``PASS_OVERHEAD_TOKENS`` per run, each
    within the caps (``tokens`` also counts the ``shared`` prompt; a run of one is always allowed);
    on equal cost, fewer runs. Dynamic programming over the run ends, O(rows^2) at most."""
    best: list[tuple[int, int, int]] = [(0, 0, 0)]  # per prefix end b: (cost, runs, start of the last run)
    for b in range(1, len(prompts) + 1):
        options, p_max, c_max = [], 0, 0
        for a in range(b - 1, -1, -1):  # the last run is [a, b): it grows as a falls, and so do its tokens
            p_max, c_max = max(p_max, prompts[a]), max(c_max, completions[a])
            padded = (b - a) * (p_max + c_max)
            if b - a > 1 and (size is not None and b - a > size or tokens is not None and shared + padded > tokens):
                break
            options.append((best[a][0] + padded + PASS_OVERHEAD_TOKENS, best[a][1] + 1, -a))
        cost, runs, a = min(options)  # ties: the fewest runs, then the longest earlier runs
        best.append((cost, runs, -a))
    runs, b = [], len(prompts)
    while b > 0:
        runs.append((best[b][2], b))
        b = best[b][2]
    return runs[::-1]


def _decoder_or_model(policy: Policy, decoder_only: bool):
    """``run(keep, **inputs)`` -> (outputs, the model's return value): the final hidden states
    (``decoder_only``; the vocabulary projection is left to ``token_logprobs``) or the full model's
    logits for the last ``keep`` positions (0: all)."""
    model = policy.model.get_base_model()

    def run(keep: int = 0, **inputs: Any) -> tuple[torch.Tensor, Any]:
        if decoder_only:
            out = model.get_decoder()(**inputs)
            return out.last_hidden_state, out
        out = model(**inputs, logits_to_keep=keep)
        return out.logits, out

    return run


class SharedPrompt:
    """A group's prompt, run once for all the micro-batches the group is cut into.

    Its outputs (the last position's output, which predicts completion token 0, and every
    layer's keys and values) go to each micro-batch as the same tensors. Under autograd they are
    detached leaves: each micro-batch's backward stops there and adds its gradient to theirs,
    and ``backward()``, after the group's last micro-batch, runs the prompt's own backward once
    with the sum. The gradients are those of one pass over the whole group, summed in another order.
    """

    def __init__(self, policy: Policy, prompt_ids: Sequence[int], decoder_only: bool, detach: bool = True):
        """``detach=False``: the micro-batch's backward runs through the prompt's (one micro-batch per group)."""
        self.ids, self.decoder_only = list(prompt_ids), decoder_only
        outputs, out = _decoder_or_model(policy, decoder_only)(1, input_ids=torch.tensor([self.ids], device=policy.device), use_cache=True)
        self.cache = out.past_key_values
        self.outputs = [outputs[:, -1:]] + [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        detach = detach and torch.is_grad_enabled()
        self.inputs = [t.detach().requires_grad_() for t in self.outputs] if detach else self.outputs

    def expanded(self, rows: int) -> tuple[torch.Tensor, Any]:
        """(the output predicting token 0, [rows, 1, H or V]; a KV cache of the prompt for ``rows`` rows)."""
        cache = copy.copy(self.cache)  # the layers' other state (lengths, sliding windows) as after the prompt
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        for i, layer in enumerate(cache.layers):  # one prompt KV for every row; gradients from all rows sum into it
            keys, values = self.inputs[1 + 2 * i], self.inputs[2 + 2 * i]
            layer.keys, layer.values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)
        return self.inputs[0].expand(rows, -1, -1), cache

    def backward(self) -> None:
        """The prompt's backward, with the gradients its micro-batches left on its outputs."""
        pairs = [(out, leaf.grad) for out, leaf in zip(self.outputs, self.inputs) if out is not leaf and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        self.outputs = self.inputs = []


def _forward(policy: Policy, batch: TokenBatch, decoder_only: bool, prompt: SharedPrompt | None = None) -> torch.Tensor:
    """Per completion position, the model output that predicts that token. [B, T, H or V]

    ``decoder_only``: the final hidden states (the vocabulary projection is left to
    ``token_logprobs``); otherwise the full model's logits. ``prompt``: the shared prompt's pass,
    already run (a group cut into several micro-batches); else the shared layout runs its own.
    """
    device = policy.device
    run = _decoder_or_model(policy, decoder_only)
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
    if prompt is None:
        prompt = SharedPrompt(policy, batch.shared_prompt, decoder_only, detach=False)
    if prompt.ids != batch.shared_prompt or prompt.decoder_only != decoder_only:
        raise ValueError("the shared prompt's pass is of another prompt or output")
    first, cache = prompt.expanded(B)
    attention = torch.cat([torch.ones((B, P), dtype=torch.long), batch.completion_attention_BT], dim=1).to(device)
    outputs, _ = run(
        input_ids=batch.completion_BT.to(device),
        attention_mask=attention,
        position_ids=torch.arange(P, P + T, device=device).expand(B, -1),
        past_key_values=cache,
        use_cache=True,
    )
    return torch.cat([first, outputs[:, :-1]], dim=1)  # the prompt's last output predicts token 0


def fused_head(policy: Policy) -> torch.nn.Linear | None:
    """The output layer, when logits are exactly ``h @ W.T`` (no bias, soft-capping or scaling),
    so ``token_logprobs`` may compute them; else None and the model computes its own logits."""
    head = policy.model.get_base_model().get_output_embeddings()
    plain = type(head) is torch.nn.Linear and head.bias is None
    return head if plain and _head_gives_logits(policy) else None


def _head_gives_logits(policy: Policy) -> bool:
    """Whether the model's logits are its output layer's output as is (no soft-capping or scaling after it)."""
    config = policy.model.get_base_model().config
    return all(getattr(config, name, None) in (None, 1.0) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def completion_logprobs(
    policy: Policy, batch: TokenBatch, with_entropy: bool = False, fused: bool = True, prompt: SharedPrompt | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens under the policy, at each sample's temperature. [B, T]

    With ``with_entropy``, also each position's entropy (detached). [B, T]
    Only real completion positions reach the vocabulary: through ``token_logprobs`` for a plain
    output layer (``fused_head``), else through the output layer itself (a LoRA-wrapped or biased
    one) when the model's logits are its output as is. ``fused=False`` forces the model's own
    logits at every position (the path for soft-capped or scaled logits, and a reference in tests).
    ``prompt``: the shared prompt's pass (``SharedPrompt``), run once for a group cut into several
    micro-batches; it must have been made with ``uses_hidden_states(policy, fused)``.
    """
    device = policy.device
    tokens_BT = batch.completion_BT.to(device)
    B, T = tokens_BT.shape
    temperature_BT = batch.temperature_B.to(device)[:, None].expand(B, T)
    head = fused_head(policy) if fused else None
    real_BT = batch.completion_attention_BT.to(device).bool()  # padding needs no vocabulary projection
    entropy_BT = None
    if head is not None:
        hidden_BTH = _forward(policy, batch, decoder_only=True, prompt=prompt)
        logp_N, entropy_N = token_logprobs(hidden_BTH[real_BT], head.weight, tokens_BT[real_BT], temperature_BT[real_BT])
        logp_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, logp_N)
        entropy_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, entropy_N) if with_entropy else None
        return logp_BT.cpu(), (entropy_BT.cpu() if entropy_BT is not None else None)
    if uses_hidden_states(policy, fused):  # the output layer on real positions only
        hidden_NH = _forward(policy, batch, decoder_only=True, prompt=prompt)[real_BT]
        logits_XV = policy.model.get_base_model().get_output_embeddings()(hidden_NH).float() / temperature_BT[real_BT][:, None]
        tokens_X = tokens_BT[real_BT]
    else:
        logits_XV = _forward(policy, batch, decoder_only=False, prompt=prompt).float() / temperature_BT[..., None]
        tokens_X = tokens_BT
    logp_X = logits_XV.gather(-1, tokens_X[..., None])[..., 0] - torch.logsumexp(logits_XV, dim=-1)
    if with_entropy:
        with torch.no_grad():
            log_probs = torch.log_softmax(logits_XV, dim=-1)
            entropy_BT = -(log_probs.exp() * log_probs).sum(-1)
    if logp_X.dim() == 1:  # real positions only: back to [B, T]
        logp_X = torch.zeros((B, T), device=device).masked_scatter(real_BT, logp_X)
        if entropy_BT is not None:
            entropy_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, entropy_BT)
    return logp_X.cpu(), (entropy_BT.detach().cpu() if entropy_BT is not None else None)


def uses_hidden_states(policy: Policy, fused: bool = True) -> bool:
    """Whether ``completion_logprobs(policy, ..., fused=fused)`` projects hidden states itself
    (else the model computes logits): what a ``SharedPrompt`` for it must hold."""
    return fused and _head_gives_logits(policy)


class GRPOUpdate:
    """Owns the optimizer; ``step(samples, advantages)`` is one policy update."""

    def __init__(self, policy: Policy, config: GRPOConfig):
        self.policy = policy
        self.config = config
        self.optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=config.lr, weight_decay=config.weight_decay)

    def step(self, samples: Sequence[Sample], advs: Sequence[float]) -> dict[str, float]:
        # small blocks mapped, heaps trimmed after (agl/memory.py); LoRA layers as one matmul each (agl/merged_lora.py)
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
        batches = [
            TokenBatch.build([samples[i] for i in chunk], pad_id, cfg.mask_truncated, min_shared_rows=1 if part else 2)
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
        with checkpointed_layers(policy.model, cfg.gradient_checkpointing):  # activations of one layer at a time (agl/checkpointing.py)
            for _ in range(cfg.num_iterations):
                self.optimizer.zero_grad(set_to_none=True)
                prompt = None
                for i, (b, adv_B, w_BT, ref_BT) in enumerate(zip(batches, adv_chunks, weights, refs)):
                    start = time.perf_counter()
                    if first[i]:
                        prompt = SharedPrompt(policy, b.shared_prompt, hidden)
                    logp_BT, entropy_BT = completion_logprobs(policy, b, with_entropy=True, prompt=prompt if parts[i] else None)
                    loss, stats = policy_loss(
                        logp_BT, b.old_logp_BT, adv_B, b.mask_BT, w_BT,
                        loss_type=cfg.loss_type, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                        beta=cfg.beta, ref_logp_BT=ref_BT,
                        sapo_tau_pos=cfg.sapo_tau_pos, sapo_tau_neg=cfg.sapo_tau_neg, opmd_tau=cfg.opmd_tau,
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
                    sums["input_tokens"] += b.num_input_tokens - (len(b.shared_prompt) if parts[i] and not first[i] else 0)
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
