"""Advantage estimators, registered by name: each rollout's advantage, from its group's rewards.

An estimator is a function ``fn(rewards_G, batch_rewards_N) -> advantages_G`` decorated with
``register_advantage``: the rewards of one group of G rollouts of the same task, and the rewards of
the whole step (one per sample: its context, e.g. for a batch-level scale). ``algo.advantage``
names it, or gives ``module:function`` for one in your own file.

A group whose rewards are all equal (or that has one rollout) is *flat*: it has no signal whatever
the estimator, every advantage in it is 0, and ``drop_zero_std`` leaves it out of the update.

  ==============  ======================================================  ============================
  ``advantage``   A_i                                                     source
  ==============  ======================================================  ============================
  ``grpo``        (r_i - mean(r)) / (std(r) + eps)                        GRPO (Shao et al. 2024)
  ``grpo_batch``  (r_i - mean(r)) / (std of the step's rewards + eps)     Hu et al. 2025 (REINFORCE++)
  ``dr_grpo``     r_i - mean(r)                                           Dr. GRPO (Liu et al. 2025)
  ``rloo``        r_i - mean of the group's other rewards                 RLOO (Ahmadian et al. 2024)
  ==============  ======================================================  ============================
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agl.train.registry import Registry
from agl.train.samples import Sample

EPS = 1e-4  # keeps a group of nearly equal rewards from dividing by ~0


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn(rewards_G, batch_rewards_N) -> advantages_G``."""

    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, rewards_G: torch.Tensor, batch_rewards_N: torch.Tensor) -> torch.Tensor:
        return self.fn(rewards_G, batch_rewards_N)


ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", "algo.advantage", AdvantageEstimator, "register_advantage"
)


def register_advantage(
    name: str | None = None,
) -> Callable[[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]], AdvantageEstimator]:
    """Decorate ``fn(rewards_G, batch_rewards_N) -> advantages_G``: registered under ``name`` when one
    is given (``algo.advantage=<name>``), usable as ``algo.advantage=module:function`` either way."""

    def decorate(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> AdvantageEstimator:
        estimator = AdvantageEstimator(name or fn.__name__, fn)
        if name is not None:
            ESTIMATORS.register(name, estimator)
        return estimator

    return decorate


@register_advantage("grpo")
def grpo(rewards_G: torch.Tensor, batch_rewards_N: torch.Tensor) -> torch.Tensor:
    """Centred on the group's mean, scaled by the group's std.

    Examples:
        >>> [round(a, 4) for a in grpo(torch.tensor([1., 0., 0., 1.]), torch.zeros(4)).tolist()]  # std 0.5774
        [0.8659, -0.8659, -0.8659, 0.8659]
    """
    return (rewards_G - rewards_G.mean()) / (rewards_G.std() + EPS)


@register_advantage("grpo_batch")
def grpo_batch(rewards_G: torch.Tensor, batch_rewards_N: torch.Tensor) -> torch.Tensor:
    """Centred on the group's mean, scaled by the whole step's std (one scale for every group)."""
    batch_std = float(batch_rewards_N.std()) if len(batch_rewards_N) > 1 else 0.0
    return (rewards_G - rewards_G.mean()) / (batch_std + EPS)


@register_advantage("dr_grpo")
def dr_grpo(rewards_G: torch.Tensor, batch_rewards_N: torch.Tensor) -> torch.Tensor:
    """Centred only: an easy or a hard task's group is not scaled up."""
    return rewards_G - rewards_G.mean()


@register_advantage("rloo")
def rloo(rewards_G: torch.Tensor, batch_rewards_N: torch.Tensor) -> torch.Tensor:
    """Leave-one-out: each rollout against the mean of the group's others (an unbiased baseline).

    Examples:
        >>> rloo(torch.tensor([1., 0., 0., 1.]), torch.zeros(4)).tolist()
        [0.6666666865348816, -0.6666666865348816, -0.6666666865348816, 0.6666666865348816]
    """
    G = len(rewards_G)
    return (rewards_G - (rewards_G.sum() - rewards_G) / (G - 1)) if G > 1 else torch.zeros_like(rewards_G)


def advantages(samples: Sequence[Sample], estimator: AdvantageEstimator) -> tuple[list[float], set[Any]]:
    """Each sample's advantage, comparing its rollout with the others of its group, and the flat
    groups (all rewards equal, or one rollout), whose advantages are all 0."""
    by_group: dict[Any, dict[str, float]] = defaultdict(dict)
    for sample in samples:  # one reward per rollout: a merged multi-turn rollout may still give several samples
        by_group[sample.group][sample.rollout_id] = sample.reward
    batch_rewards_N = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    adv_by_rollout: dict[str, float] = {}
    flat = set()
    for group, per_rollout in by_group.items():
        rewards_G = torch.tensor(list(per_rollout.values()), dtype=torch.float32)
        if len(rewards_G) < 2 or float(rewards_G.std()) == 0.0:
            flat.add(group)
            adv_by_rollout.update(dict.fromkeys(per_rollout, 0.0))
        else:
            adv_by_rollout.update(zip(per_rollout, estimator(rewards_G, batch_rewards_N).tolist()))
    return [adv_by_rollout[s.rollout_id] for s in samples], flat


def drop_groups(samples: Sequence[Sample], advs: Sequence[float], groups: set[Any]) -> tuple[list[Sample], list[float]]:
    """The samples outside ``groups``, with their advantages. For the flat groups (``drop_zero_std``):
    all-zero advantages teach nothing, they would only add forward/backward cost and dilute the mean."""
    pairs = [(sample, adv) for sample, adv in zip(samples, advs) if sample.group not in groups]
    return [sample for sample, _ in pairs], [adv for _, adv in pairs]
