"""Rollouts that failed: how many, and the most common reason, for evals and training steps.

An eval or a training step in which every rollout failed has measured nothing, and a job that
went on would report a reward of 0 and exit 0. ``check_rollouts`` raises ``RolloutsFailed``
instead, its message carrying the most common error in full, so the job's ``status.json``
says ``failed`` (``agl.jobs.dispatch.run_job``) and the process exits non-zero. When only some failed,
it logs how many and the most common error, and returns them for tables.

The reason of a failed rollout is its latest attempt's ``metadata["error"]`` (set by
``agl.agents.runner.Runner`` from the agent's exception, or a timeout).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from agl.types import Rollout, RolloutStatus

if TYPE_CHECKING:
    from agl.store import SqliteStore, StoreClient

log = logging.getLogger(__name__)

NO_ERROR = "(no error recorded)"


class RolloutsFailed(RuntimeError):
    """Every rollout of an eval or a training step failed."""


@dataclasses.dataclass(frozen=True)
class Failures:
    total: int
    failed: int
    error: str | None = None  # the most common error among the failed rollouts
    error_count: int = 0  # how many of them failed with it

    def describe(self, what: str) -> str:
        """
        >>> Failures(8, 3, "ValueError: bad", 2).describe("eval test")
        '3 of 8 rollouts of eval test failed; the most common error (2 of 3): ValueError: bad'
        """
        return (
            f"{self.failed} of {self.total} rollouts of {what} failed; "
            f"the most common error ({self.error_count} of {self.failed}): {self.error}"
        )


def most_common(errors: Sequence[str]) -> tuple[str | None, int]:
    """The most frequent error and its count; ties go to the one seen first.

    >>> most_common(["b", "a", "a", "b", "c"])
    ('b', 2)
    >>> most_common([])
    (None, 0)
    """
    counts = collections.Counter(errors)
    return max(counts.items(), key=lambda item: item[1], default=(None, 0))


async def rollout_failures(store: SqliteStore | StoreClient, statuses: Mapping[str, str]) -> Failures:
    """``statuses``: {rollout_id: final status}. Reads the failed ones' latest attempts."""
    failed = [rollout_id for rollout_id, status in statuses.items() if status != RolloutStatus.SUCCEEDED]
    errors = []
    for rollout_id in failed:
        attempt = await store.get_latest_attempt(rollout_id)
        errors.append(((attempt.metadata or {}).get("error") if attempt else None) or NO_ERROR)
    error, count = most_common(errors)
    return Failures(len(statuses), len(failed), error, count)


async def check_rollouts(store: SqliteStore | StoreClient, rollouts: Sequence[Rollout], what: str) -> Failures:
    """Raise ``RolloutsFailed`` when every one of ``rollouts`` failed; log when some did."""
    failures = await rollout_failures(store, {r.rollout_id: str(r.status) for r in rollouts})
    if failures.total and failures.failed == failures.total:
        raise RolloutsFailed(failures.describe(what))
    if failures.failed:
        log.warning(failures.describe(what))
    return failures
