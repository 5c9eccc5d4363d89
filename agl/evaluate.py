"""Score a policy on a split through the same runners and route as training.

Every rollout's final reward and its ``emit_metric`` values are averaged; ``pass@k`` is
reported when each task is tried k times (a task passes when any try scores >= threshold).

``evaluate(rt, rows, ...)`` is the one evaluation used by every algorithm: GRPO's and SFT's
periodic evals, ``algo=eval`` and (through ``evaluate_rows``) ``algo=prompt_search``.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any, Sequence

from agl.adapter import final_reward
from agl.failures import check_rollouts
from agl.stats import is_binary, paired_change, rate_with_interval
from agl.types import Rollout, RolloutStatus


async def rollout_scores(store: Any, rollouts: Sequence[Rollout]) -> list[dict]:
    """One row per rollout: its status, final reward and metrics (from its latest attempt's spans)."""
    rows = []
    for rollout in rollouts:
        row: dict[str, Any] = {"rollout_id": rollout.rollout_id, "status": str(rollout.status), "task_id": (rollout.metadata or {}).get("task_id")}
        if rollout.status == RolloutStatus.SUCCEEDED:
            spans = await store.query_spans(rollout.rollout_id, "latest")
            reward = final_reward(spans)
            if reward is not None:
                row["reward"] = reward
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
    for name in score_names(rows)[1:]:
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


def score_names(rows: Sequence[dict]) -> list[str]:
    """The per-rollout scores of ``rows``: ``reward`` and every emitted metric."""
    return ["reward"] + sorted({key for r in rows for key in r} - {"rollout_id", "status", "task_id", "reward", "completion_tokens"})


def rate_intervals(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """Wilson 95% intervals of the scores that are 0/1 per rollout (failed rollouts count 0)."""
    out = {}
    for name in score_names(rows):
        values = [r.get(name, 0.0) for r in rows]
        if is_binary(values):
            out[name] = rate_with_interval(values)
    return out


def paired_changes(before: Sequence[dict], after: Sequence[dict]) -> dict[str, dict[str, float]]:
    """McNemar comparisons of two greedy evals of the same tasks, for every 0/1 score."""
    out = {}
    for name in score_names(after):
        b = {r["task_id"]: r.get(name, 0.0) for r in before}
        a = {r["task_id"]: r.get(name, 0.0) for r in after}
        if is_binary(list(b.values())) and is_binary(list(a.values())):
            out[name] = paired_change(b, a)
    return out


# ----------------------------------------------------------------------------- running an evaluation


def _matches(metadata: dict | None, tag: dict) -> bool:
    metadata = metadata or {}
    return all(metadata.get(key) == value for key, value in tag.items())


async def evaluate_rows(
    rt: Any,
    rows: Sequence[dict],
    *,
    resources: dict,
    sampling: dict,
    k: int = 1,
    tag: dict,
    mode: str = "val",
    desc: str = "eval",
) -> list[dict]:
    """Run every task ``k`` times through the runners and the route; one score row per rollout.

    ``rt`` is an ``agl.runtime.Runtime``. ``tag`` (e.g. ``{"eval_step": 3}``) goes into every
    rollout's metadata and names this evaluation in the store: when rollouts with that tag
    already exist (a resumed run), they are reused instead of enqueued again.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    resources_id = await rt.resources_id(resources)
    inputs, metadata = [], []
    for row in rows:
        for attempt in range(k):
            inputs.append(row)
            metadata.append({**tag, "task_id": row.get("id"), "try": attempt, "sampling": dict(sampling)})
    existing = [r for r in await rt.store.query_rollouts(status=None) if _matches(r.metadata, tag)]
    if len(existing) != len(inputs):
        existing = []  # nothing (or something else) under this tag: enqueue afresh
    rollouts = await rt.run_rollouts(inputs, metadata, mode=mode, resources_id=resources_id, existing=existing, desc=desc)
    await check_rollouts(rt.store, rollouts, desc)  # all failed: the job fails, with the most common error
    return await rollout_scores(rt.store, rollouts)


async def evaluate(
    rt: Any,
    rows: Sequence[dict],
    *,
    resources: dict,
    sampling: dict,
    k: int = 1,
    tag: dict,
    pass_threshold: float = 1.0,
    desc: str = "eval",
) -> dict[str, float]:
    """``summarize(evaluate_rows(...))``: the means (and pass@k) of one evaluation."""
    scores = await evaluate_rows(rt, rows, resources=resources, sampling=sampling, k=k, tag=tag, desc=desc)
    return summarize(scores, k=k, pass_threshold=pass_threshold)


# ----------------------------------------------------------------------------- statistics and tables


def mean_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high): the normal-approximation 95% interval mean +- z * s / sqrt(n).

    ``s`` is the sample standard deviation (n - 1). With n < 2 the interval is the mean itself.
    """
    n = len(values)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def bootstrap_ci(values: Sequence[float], resamples: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean: resample the values with replacement."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * (resamples - 1))], means[int(round((1 - tail) * (resamples - 1)))]


def fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}g}" if abs(value) >= 1e4 or (value and abs(value) < 1e-3) else f"{value:.{digits}f}".rstrip("0").rstrip(".") or "0"
    return "" if value is None else str(value)


# Metrics derived from a 0/1 score by eval_during_training: its Wilson interval, and the paired
# comparison with the baseline. Tables show them inside the score's own cell, not as columns.
DERIVED_SUFFIXES = ("_lo", "_hi", "_base", "_gained", "_lost", "_p")


def is_derived(row: dict, key: str) -> bool:
    return any(key.endswith(suffix) and key[: -len(suffix)] in row for suffix in DERIVED_SUFFIXES)


def with_interval(row: dict, key: str) -> Any:
    """``row[key]``, as "rate [lo, hi]" when its interval is in the row too.

    >>> with_interval({"eval/correct": 0.05, "eval/correct_lo": 0.0215, "eval/correct_hi": 0.1118}, "eval/correct")
    '0.05 [0.0215, 0.1118]'
    """
    value = row.get(key)
    if value is None or f"{key}_lo" not in row:
        return value
    return f"{fmt(value)} [{fmt(row[key + '_lo'])}, {fmt(row[key + '_hi'])}]"


def vs_base(row: dict, key: str) -> str | None:
    """The paired comparison with the baseline in ``row``, e.g. "0.01 -> 0.05 (+6 -2, p=0.29)"."""
    if f"{key}_p" not in row:
        return None
    return (f"{fmt(row[key + '_base'])} -> {fmt(row[key])} (+{int(row[key + '_gained'])} -{int(row[key + '_lost'])}, "
            f"p={fmt(row[key + '_p'])})")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats shortened by ``fmt``."""
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda values: "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in cells)])


async def eval_during_training(rt: Any, cfg: Any, rows: Sequence[dict], step: int, slice_size: int = 0) -> dict[str, float]:
    """The GRPO and SFT trainers' greedy evaluation after ``step`` updates, as ``eval/`` metrics.

    Step 0 is the baseline before any update; it is also logged on its own (as step -1).
    Every 0/1 score gets its Wilson 95% interval (``eval/<score>_lo``, ``_hi``); after an
    update, also the paired comparison with the baseline on the same tasks
    (``eval/<score>_base``, ``_gained``, ``_lost`` and McNemar's ``_p``).

    With ``slice_size`` (the periodic evals' tasks, a prefix of ``rows``), ``eval/`` keeps
    describing that slice, so the curve stays comparable, and ``eval_all/`` describes all of
    ``rows`` (the baseline and final evals on a whole split).
    """
    from agl.checkpoint import log_baseline  # here: `report=` uses this module without loading torch

    if not rows:
        return {}
    scores = await evaluate_rows(
        rt, rows, resources=rt.task.resources_for(cfg.task.prompt),
        sampling={"temperature": 0.0, "max_tokens": cfg.algo.max_tokens}, tag={"eval_step": step}, desc=f"eval@{step}",
    )
    baseline = None
    if step != 0 and (rollouts := [r for r in await rt.store.query_rollouts() if _matches(r.metadata, {"eval_step": 0})]):
        baseline = await rollout_scores(rt.store, rollouts)
    sliced = slice_size and len(scores) > slice_size
    metrics = eval_metrics("eval", scores[:slice_size] if sliced else scores, baseline)
    if sliced:
        metrics.update(eval_metrics("eval_all", scores, baseline))
    if step == 0:
        await log_baseline(rt, metrics)
    return metrics


def eval_metrics(prefix: str, scores: Sequence[dict], baseline: Sequence[dict] | None) -> dict[str, float]:
    """Means, Wilson intervals of the 0/1 scores, and (given the baseline's scores) the paired
    comparison on the tasks both scored, as ``<prefix>/<name>`` metrics."""
    metrics = {f"{prefix}/{k}": v for k, v in summarize(scores).items()}
    for name, rate in rate_intervals(scores).items():
        metrics[f"{prefix}/{name}_lo"], metrics[f"{prefix}/{name}_hi"] = rate["lo"], rate["hi"]
    for name, change in paired_changes(baseline or [], scores).items():
        for key in ("before", "gained", "lost", "p"):
            metrics[f"{prefix}/{name}_{'base' if key == 'before' else key}"] = change[key]
    return metrics
