"""Score a policy on a split through the same runners and route as training.

Every rollout's final reward and its ``emit_metric`` values are averaged; ``pass@k`` is
reported when each task is tried k times (a task passes when any try scores >= threshold).

``evaluate(rt, rows, ...)`` is the one evaluation used by every algorithm: GRPO's and SFT's
periodic evals, ``algo=eval`` and (through ``evaluate_rows``) ``algo=prompt_search``.
Statistics live in ``agl.eval.stats``, table formatting in ``agl.report.tables`` (neither loads torch).
"""

from __future__ import annotations

import functools
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agl.agents.api import METRIC_SPAN, final_reward
from agl.eval.cache import EXACT, SAMPLE, CacheEntry, EvalCache, eval_components, row_key
from agl.eval.failures import check_rollouts
from agl.eval.stats import is_binary, paired_change, rate_with_interval
from agl.types import Rollout, RolloutStatus

if TYPE_CHECKING:
    from agl.runtime import Runtime
    from agl.store import SqliteStore, StoreClient


async def rollout_scores(store: SqliteStore | StoreClient, rollouts: Sequence[Rollout]) -> list[dict]:
    """One row per rollout: its status, final reward and metrics (from its latest attempt's spans, or, for a
    row the eval cache supplied, from its metadata's ``cached``; then the row says which kind it is)."""
    return [(await _score_and_reply(store, rollout))[0] for rollout in rollouts]


async def _score_and_reply(store: SqliteStore | StoreClient, rollout: Rollout) -> tuple[dict, str | None]:
    """A rollout's score row, and the policy's last reply in it (what the eval cache keeps for report.md)."""
    metadata = rollout.metadata or {}
    row: dict[str, Any] = {
        "rollout_id": rollout.rollout_id,
        "status": str(rollout.status),
        "task_id": metadata.get("task_id"),
    }
    if cached := metadata.get("cached"):
        return {**row, **cached["score"], "cached": cached["kind"]}, cached.get("reply")
    reply = None
    if rollout.status == RolloutStatus.SUCCEEDED:
        spans = await store.query_spans(rollout.rollout_id, "latest")
        reward = final_reward(spans)
        if reward is not None:
            row["reward"] = reward
        for span in spans:
            if span.name == METRIC_SPAN:
                row[span.attributes["name"]] = float(span.attributes["value"])
            elif span.name.startswith("llm.") and span.attributes.get("trainable", True):
                reply = span.attributes.get("response_text", reply)
        row["completion_tokens"] = sum(len(s.response_token_ids or []) for s in spans)
    return row, reply


def summarize(rows: Sequence[dict], k: int = 1, pass_threshold: float = 1.0) -> dict[str, float]:
    """Means over rollouts (failed rollouts count as reward 0) plus pass@k over tasks.

    >>> summarize([{"status": "succeeded", "task_id": 1, "reward": 1.0}, {"status": "failed", "task_id": 1}], k=2)
    {'n': 2.0, 'reward': 0.5, 'failed': 0.5, 'pass@2': 1.0}
    """
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
    return ["reward"] + sorted(
        {key for r in rows for key in r} - {"rollout_id", "status", "task_id", "reward", "completion_tokens", "cached"}
    )


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


def split_rows(rows: list[dict], size: int | None, distinct: bool = False) -> list[dict]:
    """The first ``size`` rows (all when size is 0/None); ``distinct`` drops rows whose id repeats."""
    if distinct:
        seen, unique = set(), []
        for row in rows:
            key = row.get("id", id(row))
            if key not in seen:
                seen.add(key)
                unique.append(row)
        rows = unique
    return rows[:size] if size else rows


def end_eval_rows(rows: list[dict], eval_size: int, final_size: int | None, seed: int = 0) -> list[dict]:
    """The baseline's and the final eval's rows (``task.final_eval_size``): the periodic evals' slice (the first
    ``eval_size``, all when 0) when ``final_size`` is None; the whole split when 0; else that slice and a seeded
    choice of the other rows up to ``final_size``, in the split's order. The slice comes first, so the periodic
    evals stay comparable with these; the choice depends on ``seed`` (``task.final_eval_seed``) alone, so every
    run and every job of a sweep evaluates the same problems (and shares their eval cache rows).

    >>> [r["id"] for r in end_eval_rows([{"id": i} for i in range(10)], 2, 5)]
    [0, 1, 5, 8, 9]
    """
    head = rows[:eval_size] if eval_size else rows
    if final_size is None:
        return head
    if not final_size or final_size >= len(rows):
        return rows
    if final_size <= len(head):
        return head[:final_size]
    rest = range(len(head), len(rows))
    chosen = sorted(random.Random(seed).sample(rest, final_size - len(head)))
    return head + [rows[i] for i in chosen]


def sampling_of(algo: Any) -> dict:
    """The decoding settings of an eval-like ``algo`` section (temperature, max_tokens, top_p when it matters)."""
    sampling = {"temperature": float(algo.temperature), "max_tokens": int(algo.max_tokens)}
    if algo.temperature > 0 and algo.top_p != 1.0:
        sampling["top_p"] = float(algo.top_p)
    return sampling


async def evaluate_rows(
    rt: Runtime,
    rows: Sequence[dict],
    *,
    resources: dict,
    sampling: dict,
    k: int = 1,
    tag: dict,
    mode: str = "val",
    desc: str = "eval",
    split: str | None = None,
) -> list[dict]:
    """Run every task ``k`` times through the runners and the route; one score row per rollout.

    ``rt`` is an ``agl.runtime.Runtime``. ``tag`` (e.g. ``{"eval_step": 3}``) goes into every
    rollout's metadata and names this evaluation in the store: when rollouts with that tag
    already exist (a resumed run), they are reused instead of enqueued again. They are found
    with ``query_rollouts(metadata=tag)``, an index probe for the tags agl uses.

    With ``split`` (the rows' split) a greedy eval goes through the eval cache (agl/eval/cache.py): the
    rows it holds are recorded in the store as finished rollouts (in order, so every later rollout
    keeps the id, and the seed, it would have had), only the others run, and each one that succeeds is
    kept as it ends, so a killed eval leaves its finished rows to the next run.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    resources_id = await rt.resources_id(resources)
    inputs, metadata = [], []
    for row in rows:
        for attempt in range(k):
            inputs.append(row)
            metadata.append({**tag, "task_id": row.get("id"), "try": attempt, "sampling": dict(sampling)})
    entry = _cache_entry(rt, resources, sampling, split)
    keep = functools.partial(_keep_rows, rt.store, entry, split) if entry is not None else None
    existing = await rt.store.query_rollouts(metadata=tag)
    if len(existing) != len(inputs):
        existing = []  # nothing (or something else) under this tag: enqueue afresh
    if existing or entry is None:  # a resumed eval: the store holds it (the cache still learns what ends)
        rollouts = await rt.run_rollouts(
            inputs, metadata, mode=mode, resources_id=resources_id, existing=existing, desc=desc, on_finished=keep
        )
    else:
        async with entry.computing():  # another job computing these rows: wait for it, then take them
            keys = [row_key(split, row, m["try"]) for row, m in zip(inputs, metadata)]
            known = entry.read(keys) if entry.readable else {}
            finished = []
            for i, key in enumerate(keys):
                record = known.get(key)
                if record is not None:
                    metadata[i] = {**metadata[i], "cached": {k: record[k] for k in ("kind", "score", "reply")}}
                finished.append(RolloutStatus.SUCCEEDED if record is not None else None)
            hits = sum(r is not None for r in finished)
            if hits:
                print(
                    f"{desc}: {hits} of {len(inputs)} rows from the eval cache ({entry.kind}: "
                    f"{CACHE_KINDS[entry.kind]}), {len(inputs) - hits} to run; {entry.path}"
                )
            rollouts = await rt.run_rollouts(
                inputs,
                metadata,
                mode=mode,
                resources_id=resources_id,
                desc=desc,
                finished=finished,
                on_finished=keep,
            )
    await check_rollouts(rt.store, rollouts, desc)  # all failed: the job fails, with the most common error
    return await rollout_scores(rt.store, rollouts)


CACHE_KINDS = {
    EXACT: "computed batch-invariant, replayed bit for bit",
    SAMPLE: "computed batched, an equally valid sample of this eval, not its replay",
}


def cached_rows(scores: Sequence[dict]) -> dict[str, int]:
    """How many score rows the eval cache supplied, by kind (``exact``, ``sample``)."""
    counts: dict[str, int] = {}
    for row in scores:
        if kind := row.get("cached"):
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def describe_cached(counts: dict[str, int], total: int) -> str:
    """One line: which of an eval's ``total`` rows the eval cache supplied, and what kind they are."""
    parts = [f"{n} {kind} ({CACHE_KINDS[kind]})" for kind, n in sorted(counts.items())]
    return f"{sum(counts.values())} of {total} rows from the eval cache: " + ", ".join(parts)


def cached_row_count(rt: Runtime, rows: Sequence[dict], resources: dict, sampling: dict, split: str | None) -> int:
    """How many of ``rows`` (one try each) the eval cache holds for this eval now (unchecked: a plan's estimate)."""
    entry = _cache_entry(rt, resources, sampling, split)
    if entry is None or not entry.readable:
        return 0
    return sum(entry.row_path(row_key(split, row, 0)).is_file() for row in rows)


def _cache_entry(rt: Runtime, resources: dict, sampling: dict, split: str | None) -> CacheEntry | None:
    """The eval cache's entry for this eval, or None: no split given, ``eval_cache.reuse=off``, or sampled."""
    config = getattr(rt, "eval_cache_config", None)
    if split is None or config is None or float(sampling.get("temperature", 0.0)) > 0:
        return None
    cache = EvalCache(config)
    return cache.entry(eval_components(rt, resources, sampling)) if cache.enabled else None


async def _keep_rows(
    store: SqliteStore | StoreClient, entry: CacheEntry, split: str | None, ended: Sequence[Rollout]
) -> None:
    """Write the rows of the rollouts that just succeeded (not the cache's own) into the entry."""
    for rollout in ended:
        metadata = rollout.metadata or {}
        if rollout.status != RolloutStatus.SUCCEEDED or "cached" in metadata:
            continue
        row, reply = await _score_and_reply(store, rollout)
        score = {k: v for k, v in row.items() if k not in ("rollout_id", "status", "task_id")}
        key = row_key(split, rollout.input, metadata.get("try", 0))
        entry.write(key, task_id=row["task_id"], attempt=metadata.get("try", 0), score=score, reply=reply)


async def evaluate(
    rt: Runtime,
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


# ----------------------------------------------------------------------------- during training


async def eval_during_training(
    rt: Runtime, rows: Sequence[dict], step: int, max_tokens: int, slice_size: int = 0, rl_from: int | None = None
) -> dict[str, float]:
    """The GRPO and SFT trainers' greedy evaluation after ``step`` updates (replies of at most ``max_tokens``,
    the task's prompt), as ``eval/`` metrics.

    Step 0 is the baseline before any update (the trainers log it on its own, as step -1:
    ``agl.train.resume.log_baseline``).
    Every 0/1 score gets its Wilson 95% interval (``eval/<score>_lo``, ``_hi``); after an
    update, also the paired comparison with the baseline on the same tasks
    (``eval/<score>_base``, ``_gained``, ``_lost`` and McNemar's ``_p``).

    With ``slice_size`` (the periodic evals' tasks, a prefix of ``rows``), ``eval/`` keeps
    describing that slice, so the curve stays comparable, and ``eval_all/`` describes all of
    ``rows`` (the baseline and final evals on a whole split).

    ``rl_from``: the step of an earlier eval of the same ``rows``, where RL began (a GRPO job's warm-up's end);
    what changed since then gets the same paired comparison, as ``<score>_rl_base``, ``_rl_gained``, ``_rl_lost``
    and ``_rl_p``: the RL phase's own change, apart from the warm-up's.
    """
    if not rows:
        return {}
    scores = await evaluate_rows(
        rt,
        rows,
        resources=rt.task.resources_for(rt.task_config.prompt),
        sampling={"temperature": 0.0, "max_tokens": max_tokens},
        tag={"eval_step": step},
        desc=f"eval@{step}",
        split=rt.task_config.eval_split,
    )
    baseline = await _scores_at(rt.store, 0) if step != 0 else None
    rl_start = await _scores_at(rt.store, rl_from) if rl_from and rl_from != step else None
    sliced = slice_size and len(scores) > slice_size
    metrics = eval_metrics("eval", scores[:slice_size] if sliced else scores, baseline, rl_start)
    if sliced:
        metrics.update(eval_metrics("eval_all", scores, baseline, rl_start))
    return metrics


async def _scores_at(store: SqliteStore | StoreClient, step: int) -> list[dict] | None:
    """The score rows of the training eval after ``step`` updates, or None when there was none."""
    rollouts = await store.query_rollouts(metadata={"eval_step": step})
    return await rollout_scores(store, rollouts) if rollouts else None


def eval_metrics(
    prefix: str, scores: Sequence[dict], baseline: Sequence[dict] | None, rl_start: Sequence[dict] | None = None
) -> dict[str, float]:
    """Means, Wilson intervals of the 0/1 scores, and (given the baseline's scores) the paired
    comparison on the tasks both scored, as ``<prefix>/<name>`` metrics; given ``rl_start``'s scores (an eval of
    the same tasks where RL began), the comparison with those too, as ``<prefix>/<name>_rl_*``."""
    metrics = {f"{prefix}/{k}": v for k, v in summarize(scores).items()}
    for name, rate in rate_intervals(scores).items():
        metrics[f"{prefix}/{name}_lo"], metrics[f"{prefix}/{name}_hi"] = rate["lo"], rate["hi"]
    for label, before in (("", baseline), ("_rl", rl_start)):
        for name, change in paired_changes(before or [], scores).items():
            for key in ("before", "gained", "lost", "p"):
                metrics[f"{prefix}/{name}{label}_{'base' if key == 'before' else key}"] = change[key]
    return metrics
