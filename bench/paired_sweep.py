"""A sweep's jobs compared on the same eval tasks: each job's final greedy eval against the base
model and against one reference job, by McNemar's exact test (agl.eval.stats), with Wilson intervals.

    PYTHONPATH=. .venv/bin/python bench/paired_sweep.py <sweep dir> --vary algo.loss_type --reference grpo \
        --score says_identity --score reward --out bench/results/loss_sweep.md

Reads each job's store (read-only) and metrics.jsonl; loads no model. The final eval is the one
tagged with the job's last ``eval_step``; the base model's is ``eval_step`` 0. Jobs are grouped by
everything in their dir name except ``--vary`` (e.g. the task), and compared within a group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import defaultdict
from pathlib import Path

from agl.eval.evaluate import rollout_scores
from agl.eval.stats import paired_change, wilson_interval
from agl.report.tables import markdown_table
from agl.store import SqliteStore


async def final_and_base(job: Path, names: list[str]) -> tuple[dict, dict, list[float]]:
    """({task_id: score} of the final eval, of the baseline, each RL step's mean training reward);
    the score is the first of ``names`` the evals have."""
    store = SqliteStore.open_readonly(job / "store.sqlite")
    try:
        tagged = [r for r in await store.query_rollouts() if "eval_step" in (r.metadata or {})]
        last = max(r.metadata["eval_step"] for r in tagged)

        async def scores(step: int) -> dict:
            rows = await rollout_scores(store, [r for r in tagged if r.metadata["eval_step"] == step])
            score = next(n for n in names if any(n in row for row in rows))
            return {row["task_id"]: float(row.get(score, 0.0)) for row in rows}  # failed: 0, as eval/ counts it

        final, base = await scores(last), await scores(0)
    finally:
        await store.close()
    rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    return final, base, [r["reward_mean"] for r in rows if "reward_mean" in r]  # the RL steps' training rewards


def rate(scores: dict) -> str:
    wins, n = sum(v >= 1 for v in scores.values()), len(scores)
    lo, hi = wilson_interval(wins, n)
    return f"{wins / n:.3f} [{lo:.3f}, {hi:.3f}]"


def change(before: dict, after: dict) -> str:
    c = paired_change({k: float(v >= 1) for k, v in before.items()}, {k: float(v >= 1) for k, v in after.items()})
    return f"+{c['gained']} −{c['lost']}, p = {c['p']:.2g}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--vary", required=True, help="the override the jobs differ in, e.g. algo.loss_type")
    parser.add_argument("--reference", required=True, help="its value the others are compared with, e.g. grpo")
    parser.add_argument(
        "--score", action="append", default=[], help="a 0/1 score of the evals (repeat: the first a task has)"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    groups: dict[str, dict[str, Path]] = defaultdict(dict)
    for job in sorted(p for p in args.sweep.iterdir() if (p / "store.sqlite").exists()):
        parts = dict(part.split("-", 1) for part in job.name.split("+"))
        groups["+".join(f"{k}-{v}" for k, v in parts.items() if k != args.vary)][parts[args.vary]] = job

    out = [f"# {args.sweep.name}: final greedy evals by `{args.vary}`, paired on the same tasks\n"]
    for group, jobs in groups.items():
        results = {value: await final_and_base(job, args.score or ["reward"]) for value, job in jobs.items()}
        reference = results.get(args.reference)
        rows = []
        for value, (final, base, train) in sorted(results.items()):
            rows.append(
                [
                    f"`{value}`",
                    len(final),
                    rate(base),
                    rate(final),
                    change(base, final),
                    change(reference[0], final) if reference and value != args.reference else "",
                    f"{sum(train) / len(train):.3f} ({len(train)} steps)" if train else "",
                    " ".join(f"{r:.2f}" for r in train[:10]),
                ]
            )
        out.append(f"## {group}\n")
        out.append(
            markdown_table(
                [
                    args.vary,
                    "tasks",
                    "base",
                    "final [95% Wilson]",
                    "vs base (McNemar)",
                    f"vs `{args.reference}`",
                    "train reward, mean over RL steps",
                    "first 10 RL steps",
                ],
                rows,
            )
        )
        out.append("")
    text = "\n".join(out)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())
