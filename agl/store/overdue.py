"""Deadlines (R6) as seen by a store that cannot write.

A writable store applies due deadlines before every read, so its readers never
see an attempt past its deadline as `preparing`/`running`. A read-only store
(e.g. `report=` next to a live run) cannot: the writer's watchdog may not have
reached such an attempt yet, or the writer may be dead. So that it tells the
same story, it returns what R6 and then R4 would make of the overdue attempts
at its own clock, in the returned objects only: the attempt `timeout` or
`unresponsive` with `end_time` = now and, if it is its rollout's latest and the
rollout is not terminal, the rollout with the status R4 gives. The file is
left as it is; the next writer applies the same rules for real (possibly at a
later time, so its `end_time`s differ). Queue positions are not returned by
any read, so R6's expiry order does not matter here.

Finding the overdue attempts is one probe of the partial deadline index when
there are none.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import agl.store.rules as rules
import agl.store.txn as txn
from agl.store.codec import RolloutRow, attempt_from_row, dumps
from agl.types import Attempt, Rollout, RolloutConfig


class OverdueView:
    """Reads as they would be after R6 at `now`; `OverdueView(None)` changes nothing."""

    __slots__ = ("now", "rollouts")

    def __init__(self, now: Optional[float], rollouts: Optional[dict[str, dict[str, Any]]] = None):
        self.now = now
        self.rollouts = rollouts or {}  # rollout_id -> fields R4 changes

    @classmethod
    def at(cls, conn: sqlite3.Connection, now: float, rollout_ids: Optional[Sequence[str]] = None) -> OverdueView:
        """The view at `now` for the rollouts `rollout_ids` (None: all of them; empty:
        none, i.e. attempts only — they need no query)."""
        if rollout_ids is not None and not rollout_ids:
            return cls(now)
        sql = (
            "SELECT r.rollout_id, r.status, r.config, a.timeout_at FROM attempts a "
            "JOIN rollouts r ON r.rollout_id = a.rollout_id AND r.num_attempts = a.sequence_id "
            "WHERE a.deadline <= ?"
        )
        params: list[Any] = [now]
        if rollout_ids is not None:
            sql += " AND a.rollout_id IN (SELECT value FROM json_each(?))"
            params.append(dumps(list(rollout_ids)))
        rows = conn.execute(sql, params).fetchall()
        rollouts: dict[str, dict[str, Any]] = {}
        for rollout_id, status, config_json, timeout_at in rows:
            if rules.is_terminal(status):  # R5
                continue
            target = rules.rollout_status_for_attempt(
                rules.expired_status(timeout_at, now),
                txn.charged_attempts(conn, rollout_id),
                RolloutConfig.model_validate_json(config_json),
            )
            rollouts[rollout_id] = {"status": target, "end_time": now if rules.is_terminal(target) else None}
        return cls(now, rollouts)

    def rollout(self, row: RolloutRow) -> Rollout:
        return row.to_model(**self.rollouts.get(row.rollout_id, {}))

    def attempt(self, row: Mapping[str, Any]) -> Attempt:
        """An attempt from a row of ATTEMPT_COLUMNS."""
        attempt = attempt_from_row(row)
        deadline = row["deadline"]
        if self.now is None or deadline is None or deadline > self.now:
            return attempt
        status = rules.expired_status(row["timeout_at"], self.now)
        return attempt.model_copy(update={"status": status, "end_time": self.now})


NOTHING_OVERDUE = OverdueView(None)
"""The view of a writable store: it has applied the deadlines already."""
