"""A sweep's jobs compared on the same eval tasks: each job's final greedy eval against the base
model and against one reference job, by McNemar's exact test (agl.eval.stats), with Wilson intervals.

    PYTHONPATH=. .venv/bin/python bench/paired_sweep.py <sweep dir> --vary algo.loss.type --reference grpo \
        --score says_identity --score reward --out bench/results/loss_sweep.md

``--samples N`` adds, for each job against the reference, up to N of the tasks they score differently, with both
final replies.

Reads each job's store (read-only) and metrics.jsonl; loads no model. The final eval is the one
tagged with the job's last ``eval_step``; the base model's is ``eval_step`` 0. Jobs are grouped by
everything in their dir name except ``--vary`` (e.g. the task), and compared within a group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# private, and not renamed for this script: evaluate.py's bytes are part of every eval-cache key (agl/eval/cache.py)
from agl.eval.evaluate import _score_and_reply as score_and_reply
from agl.eval.stats import paired_change, wilson_interval
from agl.report.run_report import quote
from agl.report.tables import markdown_table
from agl.store import SqliteStore


@dataclass
class Job:
    """What a job's store and metrics.jsonl say about its evals (read-only; the score is the first of ``names``
    the evals have; a failed rollout scores 0, as eval/ counts it)."""

    final: dict  # {task_id: score} of the final eval
    base: dict  # {task_id: score} of the base model's
    train: list[float]  # each RL step's mean training reward
    replies: dict  # {task_id: (the task's input, the final eval's reply)}

    @classmethod
    async def read(cls, job: Path, names: list[str]) -> Job:
        store = SqliteStore.open_readonly(job / "store.sqlite")
        try:
            tagged = [r for r in await store.query_rollouts() if "eval_step" in (r.metadata or {})]
            last = max(r.metadata["eval_step"] for r in tagged)

            async def scores(step: int) -> tuple[dict, dict]:
                rollouts = [r for r in tagged if r.metadata["eval_step"] == step]
                rows = [await score_and_reply(store, r) for r in rollouts]
                score = next(n for n in names if any(n in row for row, _ in rows))
                return (
                    {row["task_id"]: float(row.get(score, 0.0)) for row, _ in rows},
                    {row["task_id"]: (r.input, reply) for r, (row, reply) in zip(rollouts, rows)},
                )

            (final, replies), (base, _) = await scores(last), await scores(0)
        finally:
            await store.close()
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        return cls(final, base, [r["reward_mean"] for r in rows if "reward_mean" in r], replies)


def rate(scores: dict) -> str:
    wins, n = sum(v >= 1 for v in scores.values()), len(scores)
    lo, hi = wilson_interval(wins, n)
    return f"{wins / n:.3f} [{lo:.3f}, {hi:.3f}]"


def change(before: dict, after: dict) -> str:
    c = paired_change({k: float(v >= 1) for k, v in before.items()}, {k: float(v >= 1) for k, v in after.items()})
    return f"+{c['gained']} −{c['lost']}, p = {c['p']:.2g}"


def clipped(text: object, limit: int = 600) -> str:
    text = text if isinstance(text, str) else json.dumps(text)
    return text if len(text) <= limit else text[:limit] + " …"


def differing_samples(ref_name: str, reference: Job, name: str, job: Job, n: int) -> str:
    """Up to ``n`` tasks the two final evals score differently, with both replies: half of them tasks ``job``
    gained (those first), the rest tasks it lost, in task order."""
    differ = [t for t in job.final if t in reference.final and (job.final[t] >= 1) != (reference.final[t] >= 1)]
    gained = sorted((t for t in differ if job.final[t] >= 1), key=str)
    lost = sorted((t for t in differ if job.final[t] < 1), key=str)
    shown = gained[: max(n - len(lost), (n + 1) // 2)]
    shown += lost[: n - len(shown)]
    lines = [
        f"### `{name}` against `{ref_name}`: {len(shown)} of the {len(differ)} tasks they differ on "
        f"({len(gained)} gained, {len(lost)} lost)\n"
    ]
    for task in shown:
        task_input, reply = job.replies[task]
        question = task_input.get("question", task_input) if isinstance(task_input, dict) else task_input
        lines.append(f"#### {task}\n\n{quote(clipped(question))}\n")
        for label, which in ((ref_name, reference), (name, job)):
            reply = which.replies[task][1]
            lines.append(f"`{label}` (score {which.final[task]:g}):\n\n{quote(reply and clipped(reply))}\n")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--vary", required=True, help="the override the jobs differ in, e.g. algo.loss.type")
    parser.add_argument("--reference", required=True, help="its value the others are compared with, e.g. grpo")
    parser.add_argument(
        "--score", action="append", default=[], help="a 0/1 score of the evals (repeat: the first a task has)"
    )
    parser.add_argument(
        "--samples", type=int, default=0, help="show up to N tasks each job and the reference differ on"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.samples < 0:
        parser.error("--samples: a count of tasks, 0 or more")

    groups: dict[str, dict[str, Path]] = defaultdict(dict)
    for path in sorted(p for p in args.sweep.iterdir() if (p / "store.sqlite").exists()):
        parts = dict(part.split("-", 1) for part in path.name.split("+"))
        groups["+".join(f"{k}-{v}" for k, v in parts.items() if k != args.vary)][parts[args.vary]] = path

    out = [f"# {args.sweep.name}: final greedy evals by `{args.vary}`, paired on the same tasks\n"]
    for group, jobs in groups.items():
        results = {value: await Job.read(path, args.score or ["reward"]) for value, path in jobs.items()}
        reference = results.get(args.reference)
        rows = []
        for value, job in sorted(results.items()):
            rows.append(
                [
                    f"`{value}`",
                    len(job.final),
                    rate(job.base),
                    rate(job.final),
                    change(job.base, job.final),
                    change(reference.final, job.final) if reference and value != args.reference else "",
                    f"{sum(job.train) / len(job.train):.3f} ({len(job.train)} steps)" if job.train else "",
                    " ".join(f"{r:.2f}" for r in job.train[:10]),
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
        for value, job in sorted(results.items()):
            if reference and value != args.reference and args.samples:
                out.append(differing_samples(args.reference, reference, value, job, args.samples))
    text = "\n".join(out)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())
