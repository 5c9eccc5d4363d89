"""Which groups of a GRPO step can teach anything, and how many more tasks to draw when too few can.

A group teaches only when its rollouts got unequal rewards: with equal rewards every group-relative advantage is
zero, whatever the estimator (``algo.advantage``, the loss). A task the policy always solves, or never does,
gives such a flat group; a sparse 0/1 reward gives many. With ``algo.dynamic_sampling`` (DAPO's dynamic sampling,
Yu et al. 2025) a step that came back with fewer than ``batch_size`` informative groups draws more tasks from the
same seeded cursor, a round at a time, until ``batch_size`` groups are informative or ``max_extra_groups`` more have
been drawn; it then trains on the first ``batch_size`` informative groups in the order they were drawn.

Exact resume needs nothing more: every round's rollouts are recorded under the step (``metadata.step``, and
``metadata.round``), the cursor the rounds draw from is checkpointed with the step, and each round's size is a
function of the rewards before it. A resumed step replays the same rounds, reusing what each had recorded.

``InformativeWatch`` says when steps learn nothing: a streak of steps that trained on under a quarter of what they
drew gets one warning line that names what to try. Left out: carrying surplus informative groups to the next step
(verl drops them too: they would be a step off-policy), and a curriculum that samples never- or always-solved tasks
less (a win on a task with a fixed, small pool, not measured here).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agl.config import GRPOConfig
from agl.train.samples import Sample

LOW_SHARE = 0.25  # a step whose informative share is below this learned little
LOW_SHARE_STEPS = 3  # so many such steps in a row: warn


def group_rewards(samples: Iterable[Sample]) -> dict[Any, list[float]]:
    """Each group's rewards, one per rollout (a multi-turn rollout split into several samples counts once), in the
    order the samples come."""
    per_group: dict[Any, dict[str, float]] = {}
    for sample in samples:
        per_group.setdefault(sample.group, {})[sample.rollout_id] = sample.reward
    return {group: list(rewards.values()) for group, rewards in per_group.items()}


def is_informative(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ: two or more rollouts, not all equal.

    >>> is_informative([0.0, 1.0, 0.0]), is_informative([1.0, 1.0]), is_informative([0.5])
    (True, False, False)
    """
    return len(rewards) >= 2 and any(r != rewards[0] for r in rewards)


def next_draw(batch_size: int, drawn: int, informative: int, extra_left: int) -> int:
    """How many tasks the next round draws: none while ``informative`` >= ``batch_size`` or no extra draw is left;
    else the shortfall over the informative share seen so far (one informative group assumed where none was), up
    to ``extra_left``. A round's groups run together, so sizing it to the expected need is cheaper than another
    round for each missing group.

    >>> next_draw(4, 0, 0, 0), next_draw(4, 4, 4, 12), next_draw(4, 4, 2, 12), next_draw(4, 4, 1, 12)
    (4, 0, 4, 12)
    >>> next_draw(4, 4, 0, 12), next_draw(4, 8, 3, 2)
    (12, 2)
    """
    if drawn == 0:
        return batch_size
    shortfall = batch_size - informative
    if shortfall <= 0 or extra_left <= 0:
        return 0
    return min(extra_left, math.ceil(shortfall * drawn / max(informative, 1)))


@dataclasses.dataclass
class GroupDraws:
    """One step's draws: ``batch_size`` tasks first, then (``max_extra`` > 0) rounds of more until ``batch_size``
    groups are informative or ``max_extra`` more tasks were drawn."""

    batch_size: int
    max_extra: int = 0
    drawn: int = 0  # tasks drawn so far (groups enqueued)
    rounds: int = 0
    informative: list[Any] = dataclasses.field(default_factory=list)  # informative groups, in draw order
    flat: int = 0  # groups with samples whose rewards were all equal
    empty: int = 0  # groups whose every rollout failed: no samples

    def next_round(self) -> int:
        """The size of the next round (0: the step has drawn what it will)."""
        extra_left = self.batch_size + self.max_extra - self.drawn
        return next_draw(self.batch_size, self.drawn, len(self.informative), extra_left)

    def add(self, groups: Sequence[Any], rewards: Mapping[Any, Sequence[float]]) -> None:
        """A finished round: its ``groups`` in draw order, and their rewards (``group_rewards`` of its samples)."""
        self.drawn += len(groups)
        self.rounds += 1
        for group in groups:
            if group not in rewards:
                self.empty += 1
            elif is_informative(rewards[group]):
                self.informative.append(group)
            else:
                self.flat += 1

    def kept(self) -> list[Any]:
        """The groups the step trains on with dynamic sampling: the first ``batch_size`` informative ones."""
        return self.informative[: self.batch_size]

    def metrics(self, trained: int) -> dict[str, float]:
        """What a step reports of its groups; ``trained``: how many it trained on."""
        return {
            "groups_drawn": self.drawn,
            "groups_informative": len(self.informative),
            "groups_trained": trained,
            "informative_share": len(self.informative) / max(self.drawn, 1),
            "draw_rounds": self.rounds,
        }


class InformativeWatch:
    """Counts GRPO steps in a row whose informative share was under ``LOW_SHARE``; ``check`` returns the one
    warning line when the streak reaches ``LOW_SHARE_STEPS`` (once a job; its state is in the checkpoint)."""

    def __init__(self, streak: int = 0, warned: bool = False):
        self.streak, self.warned = streak, warned

    def state(self) -> dict:
        return {"streak": self.streak, "warned": self.warned}

    def check(self, share: float, algo: GRPOConfig) -> str | None:
        """A GRPO step's ``informative_share``: the warning line, the first time the streak is long enough."""
        self.streak = self.streak + 1 if share < LOW_SHARE else 0
        if self.warned or self.streak < LOW_SHARE_STEPS:
            return None
        self.warned = True
        tries = [
            f"a larger group (algo.group_size={2 * algo.group_size})",
            f"a higher temperature (algo.temperature={algo.temperature + 0.2:g})",
            f"more extra draws (algo.max_extra_groups={max(2 * algo.max_extra_groups, algo.batch_size)})"
            if algo.dynamic_sampling
            else "dynamic sampling (algo.dynamic_sampling=true)",
            "a reward that gives partial credit",
        ]
        return (
            f"the last {self.streak} GRPO steps each had fewer than {LOW_SHARE:.0%} of their groups with unequal "
            f"rewards (informative_share in metrics.jsonl), so they learned little or nothing; try "
            + ", ".join(tries[:-1])
            + f" or {tries[-1]}"
        )
