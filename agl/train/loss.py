"""GRPO-family policy losses, registered by name: pure functions of tensors.

Shapes: B sequences (a micro-batch), T completion positions. A loss sees one micro-batch as
``LossInputs``: the policy's log-probs of the sampled tokens ``logp_BT`` (with gradient), the
sampler's ``old_logp_BT``, each token's sequence advantage ``adv_BT``, and ``mask_BT``, 1 where the
policy sampled the token (tool and user turns inside a merged multi-turn sequence are 0). ``r`` is a
token's importance ratio pi_theta / pi_old, ``A`` its advantage, ``sg`` stop-gradient.

A loss is one function decorated with ``register_loss``: it returns each token's term
(``TokenTerms``), and declares its parameters (a dataclass: ``algo.loss.<key>``) and how its terms
are weighted into one number (``WEIGHTINGS``). The weights are computed once per *step*, over all
micro-batches, so gradient accumulation gives exactly the full-batch loss.

  ===========  ===============================================  =========================
  ``type``     per-token term                                   weighting
  ===========  ===============================================  =========================
  ``grpo``     PPO-clip: -min(r A, clip(r, 1-eps, 1+eps_hi) A)  ``seq-mean-token-mean``
  ``dr_grpo``  PPO-clip                                         ``seq-mean-token-sum-norm``
  ``dapo``     PPO-clip                                         ``token-mean``
  ``gspo``     PPO-clip on one ratio per sequence               ``seq-mean-token-mean``
  ``cispo``    -sg(clip(r, 1-eps, 1+eps_hi)) A log pi           ``token-mean``
  ``sapo``     -sigmoid(tau (r-1)) (4/tau) A                    ``seq-mean-token-mean``
  ``opmd``     -A log pi / (1 + tau)                            ``token-mean``
  ===========  ===============================================  =========================

Sources and how each maps onto other implementations: docs/algorithms.md "Losses".

A loss of your own, in your own file (``algo.loss.type=my_losses:clipped_tanh``)::

    @dataclasses.dataclass
    class TanhParams:
        scale: float = 2.0

    @register_loss(params=TanhParams, weighting="token-mean")
    def clipped_tanh(x: LossInputs, p: TanhParams) -> TokenTerms:
        return TokenTerms(-torch.tanh(p.scale * (x.ratio_BT - 1)) / p.scale * x.adv_BT)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from agl.config import typed
from agl.errors import ConfigError
from agl.train.registry import Registry

# ----------------------------------------------------------------------------- weightings


def _seq_mean_token_mean(mask_NT: torch.Tensor, max_length: int) -> torch.Tensor:
    lengths_N = mask_NT.sum(-1, keepdim=True).clamp(min=1)
    return mask_NT / lengths_N / mask_NT.shape[0]


def _seq_mean_token_sum_norm(mask_NT: torch.Tensor, max_length: int) -> torch.Tensor:
    return mask_NT / (mask_NT.shape[0] * max_length)


def _token_mean(mask_NT: torch.Tensor, max_length: int) -> torch.Tensor:
    return mask_NT / mask_NT.sum().clamp(min=1)


# How a step's per-token terms become one number (verl's ``loss_agg_mode`` names): a token's weight,
# given the mask of ALL N sequences of the step and its longest completion. [N, T]
WEIGHTINGS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "seq-mean-token-mean": _seq_mean_token_mean,  # mean over a sequence's tokens, then over sequences
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,  # 1 / (sequences x longest): no length bias (Dr. GRPO)
    "token-mean": _token_mean,  # every sampled token of the step counts equally (DAPO)
}


def token_weights(mask_NT: torch.Tensor, weighting: str, max_length: int) -> torch.Tensor:
    """Weight of each token in the step's loss, over ALL N sequences of the step. [N, T]

    Examples:
        >>> m = torch.tensor([[1., 1., 0.], [1., 0., 0.]])
        >>> token_weights(m, "seq-mean-token-mean", 3).tolist()   # each sequence sums to 1/N
        [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]
        >>> token_weights(m, "token-mean", 3).tolist()   # each sampled token is 1/3
        [[0.3333333432674408, 0.3333333432674408, 0.0], [0.3333333432674408, 0.0, 0.0]]
    """
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting '{weighting}' is not one of {list(WEIGHTINGS)}")
    return WEIGHTINGS[weighting](mask_NT, max_length)


# ----------------------------------------------------------------------------- what a loss sees and returns


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """One micro-batch as every loss sees it. [B, T]"""

    logp_BT: torch.Tensor  # log pi_theta of the sampled tokens, with gradient
    old_logp_BT: torch.Tensor  # log pi_old: the sampler's (recorded) or the trainer's before the step
    adv_BT: torch.Tensor  # the sequence's advantage, at each of its positions
    mask_BT: torch.Tensor  # 1 where the loss applies
    log_ratio_BT: torch.Tensor  # (logp - old_logp) * mask
    ratio_BT: torch.Tensor  # r = exp(log_ratio)

    @classmethod
    def of(
        cls, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, advantages_B: torch.Tensor, mask_BT: torch.Tensor
    ) -> LossInputs:
        log_ratio_BT = (logp_BT - old_logp_BT) * mask_BT
        ratio_BT = torch.exp(log_ratio_BT)
        return cls(logp_BT, old_logp_BT, advantages_B[:, None].expand_as(ratio_BT), mask_BT, log_ratio_BT, ratio_BT)


@dataclasses.dataclass(frozen=True)
class TokenTerms:
    """A loss's per-token terms, and what it reports about them. [B, T]"""

    loss_BT: torch.Tensor  # each token's term, before weighting
    clipped_low_BT: Optional[torch.Tensor] = None  # bool: tokens a clip acted on below (None: it does not clip)
    clipped_high_BT: Optional[torch.Tensor] = None  # ... and above
    ratio_BT: Optional[torch.Tensor] = None  # the ratio it used, when not ``LossInputs.ratio_BT`` (for ratio_mean)


@dataclasses.dataclass(frozen=True)
class NoParams:
    """A loss without parameters."""


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: its per-token function, its parameters' dataclass and its weighting."""

    name: str
    fn: Callable[[LossInputs, Any], TokenTerms]
    params: type
    weighting: str

    def __call__(self, x: LossInputs, params: Any) -> TokenTerms:
        return self.fn(x, params)

    def parameters(self, given: Mapping[str, Any], where: str = "algo.loss") -> Any:
        """``given`` (``algo.loss`` without ``type``) as an instance of ``params``; a key it lacks takes its default,
        one it does not know is a ConfigError naming the keys it takes."""
        known = [f.name for f in dataclasses.fields(self.params)]
        if unknown := [k for k in given if k not in known]:
            takes = ", ".join(known) or "no parameters"
            raise ConfigError(f"{where}.{unknown[0]}: not a parameter of loss '{self.name}' (it takes: {takes})")
        try:
            return OmegaConf.to_object(typed(self.params, dict(given)))
        except ConfigError as error:
            raise ConfigError(f"{where}.{error}") from None


LOSSES: Registry[PolicyLoss] = Registry("loss", "algo.loss.type", PolicyLoss, "register_loss")


def register_loss(
    name: str | None = None, *, params: type = NoParams, weighting: str = "token-mean"
) -> Callable[[Callable[[LossInputs, Any], TokenTerms]], PolicyLoss]:
    """Decorate a loss function ``fn(x: LossInputs, params) -> TokenTerms``: it becomes a ``PolicyLoss``,
    registered under ``name`` (``algo.loss.type=<name>``) when one is given, and usable from its own file as
    ``algo.loss.type=module:function`` either way. ``params``: a dataclass of its parameters
    (``algo.loss.<field>=...``); ``weighting``: one of ``WEIGHTINGS``."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting '{weighting}' is not one of {list(WEIGHTINGS)}")
    if not dataclasses.is_dataclass(params):
        raise TypeError(f"params must be a dataclass, not {params!r}")

    def decorate(fn: Callable[[LossInputs, Any], TokenTerms]) -> PolicyLoss:
        loss = PolicyLoss(name or fn.__name__, fn, params, weighting)
        if name is not None:
            LOSSES.register(name, loss)
        return loss

    return decorate


def resolve_loss(section: Mapping[str, Any]) -> tuple[PolicyLoss, Any]:
    """``algo.loss`` (``{"type": "sapo", "tau_pos": 1.0}``) -> the loss and its parameters."""
    given = dict(section)
    loss = LOSSES.get(str(given.pop("type", "")))
    return loss, loss.parameters(given)


# ----------------------------------------------------------------------------- the built-in losses


@dataclasses.dataclass(frozen=True)
class ClipRange:
    """The importance ratio's clip range, [1 - epsilon, 1 + epsilon_high]."""

    epsilon: float = 0.2  # the lower side
    epsilon_high: Optional[float] = 0.28  # the upper side (DAPO's clip-higher); None: epsilon

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclasses.dataclass(frozen=True)
class SapoParams:
    tau_pos: float = 1.0  # the soft gate's temperature where A > 0
    tau_neg: float = 1.05  # ... and where A <= 0 (a sharper gate)


@dataclasses.dataclass(frozen=True)
class OpmdParams:
    tau: float = 1.0  # the loss is divided by 1 + tau


def ppo_clip_per_token(ratio_BT: torch.Tensor, adv_BT: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """PPO's clipped surrogate, negated: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A). [B, T]

    Where the clip binds in the direction the advantage pushes, the min picks the constant
    branch and the token has no gradient."""
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = torch.clamp(ratio_BT, 1 - eps_low, 1 + eps_high) * adv_BT
    return -torch.min(unclipped_BT, clipped_BT)


def _ppo_clip(ratio_BT: torch.Tensor, adv_BT: torch.Tensor, clip: ClipRange) -> TokenTerms:
    """PPO-clip's terms; clipped: the tokens whose gradient the clip removes."""
    return TokenTerms(
        ppo_clip_per_token(ratio_BT, adv_BT, clip.epsilon, clip.high),
        clipped_low_BT=(ratio_BT < 1 - clip.epsilon) & (adv_BT < 0),
        clipped_high_BT=(ratio_BT > 1 + clip.high) & (adv_BT > 0),
    )


@register_loss("grpo", params=ClipRange, weighting="seq-mean-token-mean")
def grpo(x: LossInputs, p: ClipRange) -> TokenTerms:
    """GRPO (Shao et al. 2024): PPO-clip, each sequence's tokens averaged, then the sequences."""
    return _ppo_clip(x.ratio_BT, x.adv_BT, p)


@register_loss("dr_grpo", params=ClipRange, weighting="seq-mean-token-sum-norm")
def dr_grpo(x: LossInputs, p: ClipRange) -> TokenTerms:
    """Dr. GRPO (Liu et al. 2025): PPO-clip with a constant normaliser, no length bias."""
    return _ppo_clip(x.ratio_BT, x.adv_BT, p)


@register_loss("dapo", params=ClipRange, weighting="token-mean")
def dapo(x: LossInputs, p: ClipRange) -> TokenTerms:
    """DAPO (Yu et al. 2025): PPO-clip, every sampled token of the step weighted equally."""
    return _ppo_clip(x.ratio_BT, x.adv_BT, p)


@register_loss("gspo", params=ClipRange, weighting="seq-mean-token-mean")
def gspo(x: LossInputs, p: ClipRange) -> TokenTerms:
    """GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its tokens', clipped.

    The token form s_i * pi / sg(pi) keeps the value s_i while giving every token of the sequence
    the same gradient scale."""
    lengths_B = x.mask_BT.sum(-1).clamp(min=1)
    seq_log_ratio_B = x.log_ratio_BT.sum(-1) / lengths_B
    ratio_BT = torch.exp(seq_log_ratio_B.detach()[:, None] + x.logp_BT - x.logp_BT.detach())
    return dataclasses.replace(_ppo_clip(ratio_BT, x.adv_BT, p), ratio_BT=ratio_BT)


@register_loss("cispo", params=ClipRange, weighting="token-mean")
def cispo(x: LossInputs, p: ClipRange) -> TokenTerms:
    """CISPO (MiniMax-M1, 2025): -sg(clip(r, 1 - eps, 1 + eps_high)) A log pi.

    The importance weight is capped and its gradient stopped, so every token keeps a REINFORCE
    gradient; clipped here means the weight was capped (the gradient is kept). ``epsilon >= 1``
    sets no lower bound, as the paper."""
    weight_BT = torch.clamp(x.ratio_BT, 1 - p.epsilon, 1 + p.high).detach()
    return TokenTerms(
        -weight_BT * x.adv_BT * x.logp_BT,
        clipped_low_BT=x.ratio_BT < 1 - p.epsilon,
        clipped_high_BT=x.ratio_BT > 1 + p.high,
    )


@register_loss("sapo", params=SapoParams, weighting="seq-mean-token-mean")
def sapo(x: LossInputs, p: SapoParams) -> TokenTerms:
    """SAPO (Gao et al. 2025): -f(r) A with the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau.

    Its gradient is exactly the policy gradient at r = 1, decaying smoothly as r leaves 1 (faster
    for larger tau; ``tau_neg`` for negative advantages). It does not clip."""
    tau_BT = torch.where(x.adv_BT > 0, torch.full_like(x.adv_BT, p.tau_pos), torch.full_like(x.adv_BT, p.tau_neg))
    gate_BT = torch.sigmoid(tau_BT * (x.ratio_BT - 1)) * 4 / tau_BT
    return TokenTerms(-gate_BT * x.adv_BT)


@register_loss("opmd", params=OpmdParams, weighting="token-mean")
def opmd(x: LossInputs, p: OpmdParams) -> TokenTerms:
    """OPMD as Trinity-RFT implements it: -A log pi / (1 + tau); no importance ratio, no clip."""
    return TokenTerms(-x.adv_BT * x.logp_BT / (1.0 + p.tau))


# ----------------------------------------------------------------------------- one micro-batch's loss


def micro_batch_loss(
    loss: PolicyLoss,
    params: Any,
    x: LossInputs,
    weights_BT: torch.Tensor,
    beta: float = 0.0,
    ref_logp_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step loss (its terms weighted and summed, plus ``beta`` times the
    k3 estimate of KL(pi || ref)) and detached stats: the share of tokens clipped below and above,
    the mean KL and ratio, and the tokens."""
    terms = loss(x, params)
    per_token_BT = terms.loss_BT
    kl_BT = torch.zeros_like(x.logp_BT)
    if beta and ref_logp_BT is not None:
        delta_BT = ref_logp_BT - x.logp_BT  # k3: unbiased and >= 0
        kl_BT = torch.exp(delta_BT) - delta_BT - 1
        per_token_BT = per_token_BT + beta * kl_BT
    total = (per_token_BT * weights_BT).sum()
    with torch.no_grad():
        mask_BT = x.mask_BT
        n_tokens = mask_BT.sum().clamp(min=1)
        ratio_BT = x.ratio_BT if terms.ratio_BT is None else terms.ratio_BT
        none = torch.zeros_like(ratio_BT, dtype=torch.bool)
        low = none if terms.clipped_low_BT is None else terms.clipped_low_BT
        high = none if terms.clipped_high_BT is None else terms.clipped_high_BT
        stats = {
            "clip_ratio_low": (low * mask_BT).sum() / n_tokens,
            "clip_ratio_high": (high * mask_BT).sum() / n_tokens,
            "kl": (kl_BT * mask_BT).sum() / n_tokens,
            "ratio_mean": (ratio_BT * mask_BT).sum() / n_tokens,
            "tokens": mask_BT.sum(),
        }
    return total, stats
