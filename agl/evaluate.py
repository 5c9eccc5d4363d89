"""Score a policy on a split through the same runners and route as training.

Every rollout's final reward and its ``emit_metric`` values are averaged; ``pass@k`` is
reported when each task is tried k times (a task passes when any try scores >= threshold).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

from agl.types import Rollout, RolloutStatus


async def rollout_scores(store: Any, rollouts: Sequence[Rollout]) -> list[dict]:
    """One row per rollout: its status, final reward and metrics (from its latest attempt's spans)."""
    rows = []
    for rollout in rollouts:
        row: dict[str, Any] = {"rollout_id": rollout.rollout_id, "status": str(rollout.status), "task_id": (rollout.metadata or {}).get("task_id")}
        if rollout.status == RolloutStatus.SUCCEEDED:
            spans = await store.query_spans(rollout.rollout_id, "latest")
            rewards = [s for s in spans if s.name == "reward"]
            if rewards:
                row["reward"] = float(max(rewards, key=lambda s: s.sequence_id or 0).attributes["reward"])
            for span in spans:
                if span.name == "metric":
                    row[span.attributes["name"]] = float(span.attributes["value"])
            row["completion_tokens"] = sum(len(s.response_token_ids or []) for s in spans)
        rows.append(row)
    return rows


def summarize(rows: Sequence[dict], k: int = 1, pass_threshold: float = 1.0) -> dict[str, float]:
    """Means over rollouts (failed rollouts count as reward 0) plus pass@k over tasks."""
    summary: dict[str, float] = {"n": float(len(rows))}
    if not rows:
        return summary
    summary["reward"] = sum(r.get("reward", 0.0) for r in rows) / len(rows)
    summary["failed"] = sum(r["status"] != "succeeded" for r in rows) / len(rows)
    metric_names = sorted({key for r in rows for key in r} - {"rollout_id", "status", "task_id", "reward", "completion_tokens"})
    for name in metric_names:
        summary[name] = sum(r.get(name, 0.0) for r in rows) / len(rows)
    lengths = [r["completion_tokens"] for r in rows if "completion_tokens" in r]
    if lengths:
        summary["completion_tokens"] = sum(lengths) / len(lengths)
    if k > 1:
        by_task: dict[Any, list[float]] = defaultdict(list)
        for r in rows:
            by_task[r["task_id"]].append(r.get("reward", 0.0))
        summary[f"pass@{k}"] = sum(any(x >= pass_threshold for x in v) for v in by_task.values()) / len(by_task)
    return summary
