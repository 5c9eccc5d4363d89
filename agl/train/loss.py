"""GRPO-family policy losses: pure functions of tensors.

Shapes: B sequences (a micro-batch), T completion positions. ``mask_BT`` is 1 where the
policy sampled the token (tool and user turns inside a merged multi-turn sequence are 0).
``r`` is a token's importance ratio pi_theta / pi_old, ``A`` its sequence's advantage,
``sg`` stop-gradient.

A variant is a per-token term (``policy_loss``) and a way of weighting the per-token terms
into one number. The weights are computed once per *step* (over all micro-batches) by
``token_weights`` so that gradient accumulation gives exactly the full-batch loss.

  ==========  ==============================================  ==========================
  loss_type   per-token term                                   weights (``token_weights``)
  ==========  ==============================================  ==========================
  ``grpo``    PPO-clip: -min(r A, clip(r, 1-eps, 1+eps_hi) A)  mean over a sequence's
                                                               tokens, then over sequences
  ``dr_grpo`` PPO-clip                                         1 / (sequences x max length)
  ``dapo``    PPO-clip                                         1 / sampled tokens
  ``gspo``    PPO-clip on one ratio per sequence               as ``grpo``
  ``cispo``   -sg(clip(r, 1-eps, 1+eps_hi)) A log pi           as ``dapo``
  ``sapo``    -sigmoid(tau (r-1)) (4/tau) A                    as ``grpo``
  ``opmd``    -A log pi / (1 + tau)                            as ``dapo``
  ==========  ==============================================  ==========================

  - ``dr_grpo`` removes GRPO's length bias with a constant normaliser (Dr. GRPO, Liu et al. 2025).
  - ``dapo``    token-level normalisation (DAPO, Yu et al. 2025).
  - ``gspo``    the ratio is the geometric mean of the sequence's token ratios, clipped at
                the sequence level (GSPO, Zheng et al. 2025).
  - ``cispo``   clips the importance-sampling *weight* and stops its gradient, so every token
                keeps a REINFORCE gradient; PPO-clip zeroes clipped tokens (MiniMax-M1, 2025).
  - ``sapo``    a smooth gate replaces the hard clip, with a sharper gate (tau_neg) for
                negative advantages (SAPO, Gao et al. 2025, Qwen).
  - ``opmd``    online policy mirror descent as Trinity-RFT implements it: REINFORCE on
                log pi with no importance ratio, scaled by 1 / (1 + tau).

Each per-token term has its own function below, with its formula and source.

Worked example (``grpo``, one sequence, on-policy so ratio = 1, advantage 2, two tokens):
per-token loss = -min(1 * 2, clip(1) * 2) = -2 for each token, weights 1/2 each, loss = -2.
The same under ``sapo`` (tau_pos = 1): per-token -sigmoid(0) * 4 * 2 = -4, loss = -4, yet the
gradient equals ``grpo``'s, because d/dr [sigmoid(tau (r-1)) 4/tau] = 1 at r = 1.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "opmd")
_PER_SEQUENCE = ("grpo", "gspo", "sapo")  # tokens averaged within a sequence, then sequences
_PER_TOKEN = ("dapo", "cispo", "opmd")  # every sampled token of the step counts equally


def token_weights(mask_NT: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """Weight of each token in the step's loss, over ALL N sequences of the step. [N, T]

    Examples:
        >>> m = torch.tensor([[1., 1., 0.], [1., 0., 0.]])
        >>> token_weights(m, "grpo", 3).tolist()   # each sequence sums to 1/N
        [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]
        >>> token_weights(m, "dapo", 3).tolist()   # each sampled token is 1/3
        [[0.3333333432674408, 0.3333333432674408, 0.0], [0.3333333432674408, 0.0, 0.0]]
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type '{loss_type}' is not one of {LOSS_TYPES}")
    n_sequences = mask_NT.shape[0]
    if loss_type in _PER_SEQUENCE:
        lengths_N = mask_NT.sum(-1, keepdim=True).clamp(min=1)
        return mask_NT / lengths_N / n_sequences
    if loss_type == "dr_grpo":
        return mask_NT / (n_sequences * max_completion_length)
    return mask_NT / mask_NT.sum().clamp(min=1)  # _PER_TOKEN


def ppo_clip_per_token(ratio_BT: torch.Tensor, adv_BT: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO's clipped surrogate, negated: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A). [B, T]

    Where the clip binds in the direction the advantage pushes, the min picks the constant
    branch and the token has no gradient (Schulman et al. 2017; GRPO, Shao et al. 2024).
    """
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high) * adv_BT
    return -torch.min(unclipped_BT, clipped_BT)


def cispo_per_token(
    logp_BT: torch.Tensor, ratio_BT: torch.Tensor, adv_BT: torch.Tensor, eps_low: float, eps_high: float
) -> torch.Tensor:
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta. [B, T]

    Source: MiniMax-M1 (arXiv:2506.13585), the CISPO objective J = 1/sum_i|o_i| sum_i sum_t
    sg(r_hat) A log pi, r_hat = clip(r, 1 - eps_low^IS, 1 + eps_high^IS); its token-level
    normalisation is ``token_weights``' ``cispo`` (= ``dapo``), as in TRL's GRPOTrainer
    (``loss_type="cispo"``: ``-clamp(coef_1, max=epsilon_high).detach() * advantages *
    per_token_logps``, summed and divided by the batch's active tokens).

    The gradient of a token is -r_hat A d(log pi): the weight is capped, never zeroed, so
    a clipped token still learns (PPO-clip drops it). Mapping of the bounds:
      - TRL's ``epsilon_high`` is the cap itself (it recommends 5.0, from ScaleRL); here the
        cap is ``1 + eps_high`` as in the paper, so TRL's 5.0 is ``eps_high = 4.0``.
      - The paper "did not impose a lower bound" (eps_low large); TRL has none and
        Trinity-RFT's cispo defaults to clip_range_low = 1.0. Here ``eps_low >= 1`` does the
        same (r > 0); a smaller ``eps_low`` raises the weight of tokens with r < 1 - eps_low.
    Trinity-RFT's ``cispo`` loss also multiplies by a mask that zeroes the tokens PPO-clip
    would; this does not: every token keeping its gradient is the point of CISPO.
    """
    weight_BT = torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high).detach()
    return -weight_BT * adv_BT * logp_BT


def sapo_per_token(ratio_BT: torch.Tensor, adv_BT: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO: -f(r) * A, with the soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau. [B, T]

    tau = ``tau_pos`` where A > 0, else ``tau_neg``. Source: Soft Adaptive Policy
    Optimization (Gao et al., Qwen, arXiv:2511.20347); implementations read: TRL's
    GRPOTrainer (``loss_type="sapo"``, ``sapo_temperature_pos=1.0``,
    ``sapo_temperature_neg=1.05``, per-sequence mean then mean over sequences, as
    ``token_weights``' ``sapo`` here) and Trinity-RFT's ``sapo`` policy loss (``tau_pos=1.0``,
    ``tau_neg=1.05``).

    d/d(log pi) of the term is -A * 4 s (1 - s) * r with s = sigmoid(tau (r - 1)): exactly the
    plain policy gradient -A at r = 1 (whatever tau), decaying smoothly but never to zero as r
    leaves 1, faster for larger tau; the paper recommends tau_neg > tau_pos. The loss *value*
    on-policy is -2A/tau, not -A.
    """
    tau_BT = torch.where(adv_BT > 0, torch.full_like(adv_BT, tau_pos), torch.full_like(adv_BT, tau_neg))
    gate_BT = torch.sigmoid(tau_BT * (ratio_BT - 1)) * 4 / tau_BT
    return -gate_BT * adv_BT


def opmd_per_token(logp_BT: torch.Tensor, adv_BT: torch.Tensor, tau: float) -> torch.Tensor:
    """OPMD as Trinity-RFT implements it: -A * log pi_theta / (1 + tau). [B, T]

    Source: Trinity-RFT (modelscope/Trinity-RFT), ``trinity/algorithm/policy_loss_fn/
    opmd_policy_loss.py``, registered as ``opmd``: ``pg_losses = -advantages * logprob``,
    a token mean (``masked_mean``; ``token_weights``' ``opmd`` here), then divided by
    ``1.0 + tau`` with ``tau = 1.0`` by default ("for regularization (w.r.t. current
    pi_theta)"). The old log-probs are not used: no importance ratio, no clipping; that is
    what makes it usable off-policy. The design is in the Trinity-RFT report
    (arXiv:2505.17826, appendix A) and Yao, Chen et al., "Group-Relative REINFORCE Is
    Secretly an Off-Policy Algorithm" (arXiv:2509.24203, section 2.2), inspired by Kimi k1.5.

    Trinity pairs this loss with a group-mean baseline, A = r - mean(r) (its ``opmd``
    advantage, ``opmd_baseline="mean"``): here that is ``scale_rewards=none``. Note that a
    constant factor on the loss barely changes an Adam step, so tau mostly matters through
    gradient clipping and against ``beta``'s KL term.
    """
    return -adv_BT * logp_BT / (1.0 + tau)


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
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    opmd_tau: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The ``loss_type``'s per-token term (see the module docstring) plus an optional k3 KL penalty.

    Returns the micro-batch's share of the step loss (a weighted sum) and detached stats.
    ``clip_ratio_low``/``clip_ratio_high``: for the PPO-clip losses, the share of tokens whose
    gradient the clip removes; for ``cispo``, the share whose weight was capped (their gradient
    is kept); 0 for ``sapo`` and ``opmd``, which do not clip.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type '{loss_type}' is not one of {LOSS_TYPES}")
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
    if loss_type == "cispo":
        per_token_BT = cispo_per_token(logp_BT, ratio_BT, adv_BT, eps_low, eps_high)
    elif loss_type == "sapo":
        per_token_BT = sapo_per_token(ratio_BT, adv_BT, sapo_tau_pos, sapo_tau_neg)
    elif loss_type == "opmd":
        per_token_BT = opmd_per_token(logp_BT, adv_BT, opmd_tau)
    else:
        per_token_BT = ppo_clip_per_token(ratio_BT, adv_BT, eps_low, eps_high)

    kl_BT = torch.zeros_like(logp_BT)
    if beta and ref_logp_BT is not None:
        delta_BT = ref_logp_BT - logp_BT  # k3 estimator of KL(pi || ref): unbiased and >= 0
        kl_BT = torch.exp(delta_BT) - delta_BT - 1
        per_token_BT = per_token_BT + beta * kl_BT

    loss = (per_token_BT * weights_BT).sum()
    with torch.no_grad():
        n_tokens = mask_BT.sum().clamp(min=1)
        if loss_type == "cispo":
            low, high = ratio_BT < 1 - eps_low, ratio_BT > 1 + eps_high
        elif loss_type in ("sapo", "opmd"):
            low = high = torch.zeros_like(ratio_BT, dtype=torch.bool)
        else:
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


def group_advantages(
    rewards_G: torch.Tensor, scale: str = "group", eps: float = 1e-4, batch_std: float | None = None
) -> torch.Tensor:
    """Advantages of one group of G rollouts of the same task: (r - mean) / (std + eps).

    ``scale``: ``group`` divides by the group's std, ``batch`` by the whole batch's std
    (``batch_std``), ``none`` only centres (Dr. GRPO).

    Examples:
        >>> [round(a, 4) for a in group_advantages(torch.tensor([1., 0., 0., 1.])).tolist()]  # std 0.5774
        [0.8659, -0.8659, -0.8659, 0.8659]
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
