"""GRPO policy losses: pure functions of tensors.

Shapes: B sequences (a micro-batch), T completion positions. ``mask_BT`` is 1 where the
policy sampled the token (tool and user turns inside a merged multi-turn sequence are 0).

The four variants differ only in how per-token terms are weighted into one number; the
weights are computed once per *step* (over all micro-batches) by ``token_weights`` so that
gradient accumulation gives exactly the full-batch loss:

  - ``grpo``    each sequence counts equally; tokens are averaged within a sequence.
  - ``dr_grpo`` every token counts equally, normalised by a constant (sequences x max length),
                which removes GRPO's length bias (Dr. GRPO, Liu et al. 2025).
  - ``dapo``    every token counts equally, normalised by the number of sampled tokens (DAPO).
  - ``gspo``    one importance ratio per sequence, the geometric mean of its token ratios,
                clipped at the sequence level (GSPO, Zheng et al. 2025).

Worked example (``grpo``, one sequence, on-policy so ratio = 1, advantage 2, two tokens):
per-token loss = -min(1 * 2, clip(1) * 2) = -2 for each token, weights 1/2 each, loss = -2.
"""
from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo")


def token_weights(mask_NT: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """Weight of each token in the step's loss, over ALL N sequences of the step. [N, T]

    >>> m = torch.tensor([[1., 1., 0.], [1., 0., 0.]])
    >>> token_weights(m, "grpo", 3).tolist()   # each sequence sums to 1/N
    [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]
    >>> token_weights(m, "dapo", 3).tolist()   # each sampled token is 1/3
    [[0.3333333432674408, 0.3333333432674408, 0.0], [0.3333333432674408, 0.0, 0.0]]
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type '{loss_type}' is not one of {LOSS_TYPES}")
    n_sequences = mask_NT.shape[0]
    if loss_type in ("grpo", "gspo"):
        lengths_N = mask_NT.sum(-1, keepdim=True).clamp(min=1)
        return mask_NT / lengths_N / n_sequences
    if loss_type == "dr_grpo":
        return mask_NT / (n_sequences * max_completion_length)
    return mask_NT / mask_NT.sum().clamp(min=1)  # dapo


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    weights_BT: torch.Tensor,
    *,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate (token- or sequence-level ratio) plus an optional k3 KL penalty.

    Returns the micro-batch's share of the step loss (a weighted sum) and detached stats.
    """
    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    log_ratio_BT = (logp_BT - old_logp_BT) * mask_BT
    if loss_type == "gspo":
        # Sequence-level ratio s_i = exp(mean_t log ratio); the token form s_i * pi/sg(pi) keeps
        # its value while giving every token of the sequence the same gradient scale.
        lengths_B = mask_BT.sum(-1).clamp(min=1)
        seq_log_ratio_B = log_ratio_BT.sum(-1) / lengths_B
        log_ratio_BT = seq_log_ratio_B.detach()[:, None] + logp_BT - logp_BT.detach()
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = advantages_B[:, None].expand_as(ratio_BT)
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high) * adv_BT
    per_token_BT = -torch.min(unclipped_BT, clipped_BT)

    kl_BT = torch.zeros_like(logp_BT)
    if beta and ref_logp_BT is not None:
        delta_BT = ref_logp_BT - logp_BT  # k3 estimator of KL(pi || ref): unbiased and >= 0
        kl_BT = torch.exp(delta_BT) - delta_BT - 1
        per_token_BT = per_token_BT + beta * kl_BT

    loss = (per_token_BT * weights_BT).sum()
    with torch.no_grad():
        n_tokens = mask_BT.sum().clamp(min=1)
        low = (ratio_BT < 1 - eps_low) & (adv_BT < 0)
        high = (ratio_BT > 1 + eps_high) & (adv_BT > 0)
        stats = {
            "clip_ratio_low": (low * mask_BT).sum() / n_tokens,
            "clip_ratio_high": (high * mask_BT).sum() / n_tokens,
            "kl": (kl_BT * mask_BT).sum() / n_tokens,
            "ratio_mean": (ratio_BT * mask_BT).sum() / n_tokens,
            "tokens": mask_BT.sum(),
        }
    return loss, stats


def group_advantages(rewards_G: torch.Tensor, scale: str = "group", eps: float = 1e-4, batch_std: float | None = None) -> torch.Tensor:
    """Advantages of one group of G rollouts of the same task: (r - mean) / (std + eps).

    ``scale``: ``group`` divides by the group's std, ``batch`` by the whole batch's std
    (``batch_std``), ``none`` only centres (Dr. GRPO).

    >>> group_advantages(torch.tensor([1., 0., 0., 1.])).tolist()
    [0.8658..., -0.8658..., -0.8658..., 0.8658...]  # doctest: +SKIP
    """
    centred_G = rewards_G - rewards_G.mean()
    if scale == "none":
        return centred_G
    if scale == "group":
        return centred_G / (rewards_G.std() + eps)
    if scale == "batch":
        if batch_std is None:
            raise ValueError("scale='batch' needs batch_std")
        return centred_G / (batch_std + eps)
    raise ValueError(f"scale_rewards '{scale}' is not one of: group, batch, none")
