"""``algo=prompt_search``: rank the task's prompt templates by mean reward (no training).

agent-lightning's "write your first algorithm", on agl's store, runners and route: for each
candidate template, add it as a resource, enqueue rollouts of the same N tasks under it and
wait; then score each template by the mean final reward of its rollouts (a failed rollout
counts as 0). All candidates are enqueued at once, so the engine batches their calls.

Uncertainty: each mean comes with two 95% intervals over the N tasks —
  * normal approximation: mean +- 1.96 * s / sqrt(N)  (s: sample std; fine for N >= ~30), and
  * percentile bootstrap: the 2.5th and 97.5th percentiles of the mean over ``algo.bootstrap``
    resamples of the N rewards (seeded; no normality assumption, better for small N or 0/1
    rewards). The ranking is by mean; ``separated`` says whether a candidate's bootstrap
    interval lies entirely below the best one's.
Writes ``prompt_search.md`` and ``prompt_search.json`` to the run dir.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from agl.config import Config, PromptSearchConfig
from agl.errors import ConfigError
from agl.eval.evaluate import evaluate_rows, sampling_of, split_rows, summarize
from agl.eval.stats import bootstrap_ci, mean_ci
from agl.report.tables import markdown_table
from agl.runtime import Runtime


def rank(scores_by_candidate: dict[str, list[dict]], *, resamples: int = 2000, seed: int = 0) -> list[dict]:
    """One entry per candidate, best first: mean reward, both 95% intervals, metric means."""
    ranking = []
    for name, scores in scores_by_candidate.items():
        rewards = [s.get("reward", 0.0) for s in scores]
        mean, lo, hi = mean_ci(rewards)
        b_lo, b_hi = bootstrap_ci(rewards, resamples=resamples, seed=seed)
        summary = summarize(scores)
        ranking.append(
            {
                "prompt": name,
                "n": len(rewards),
                "mean": mean,
                "ci_normal": [lo, hi],
                "ci_bootstrap": [b_lo, b_hi],
                "summary": summary,
            }
        )
    ranking.sort(key=lambda r: -r["mean"])
    if ranking:
        best_lo = ranking[0]["ci_bootstrap"][0]
        for entry in ranking:
            entry["separated"] = entry is not ranking[0] and entry["ci_bootstrap"][1] < best_lo
    return ranking


async def run_prompt_search(config: Config, run_dir: Path) -> dict:
    algo: PromptSearchConfig = config.algo
    async with Runtime.of(config, run_dir) as rt:
        prompts = rt.task.prompts
        candidates = list(algo.candidates) if algo.candidates else list(prompts)
        unknown = [c for c in candidates if c not in prompts]
        if unknown:
            raise ConfigError(
                f"algo.candidates {unknown} are not prompts of task '{config.task.name}': {', '.join(prompts)}"
            )
        rows = split_rows(rt.task.load(algo.split), algo.size, distinct=True)
        if not rows:
            raise ConfigError(f"split '{algo.split}' of task '{config.task.name}' has no rows")
        await rt.record_config()
        sampling = sampling_of(algo)
        resources = {name: rt.task.resources_for(name) for name in candidates}
        for name in candidates:  # one resources version per template, added before any rollout
            await rt.resources_id(resources[name])
        results = await asyncio.gather(
            *[
                evaluate_rows(
                    rt,
                    rows,
                    resources=resources[name],
                    sampling=sampling,
                    tag={"candidate": name},
                    desc=f"prompt {name}",
                    split=algo.split,
                )
                for name in candidates
            ]
        )
        ranking = rank(dict(zip(candidates, results)), resamples=algo.bootstrap, seed=config.seed)
        await rt.store.set_run_info("prompt_search", ranking)
    best = ranking[0]
    result = {
        "task": config.task.name,
        "split": algo.split,
        "tasks": len(rows),
        "sampling": sampling,
        "best": best["prompt"],
        "best_template": prompts[best["prompt"]],
        "ranking": ranking,
        "metrics": {"best_prompt": best["prompt"], "best_mean": best["mean"]},
    }
    text = prompt_search_markdown(result, prompts)
    (run_dir / "prompt_search.md").write_text(text + "\n")
    (run_dir / "prompt_search.json").write_text(json.dumps({**result, "templates": prompts}, indent=1) + "\n")
    print(text)
    print(f"\nwritten: {run_dir / 'prompt_search.md'}, {run_dir / 'prompt_search.json'}")
    return result


def prompt_search_markdown(result: dict, prompts: dict[str, str]) -> str:
    rows = []
    for i, r in enumerate(result["ranking"], 1):
        lo, hi = r["ci_normal"]
        b_lo, b_hi = r["ci_bootstrap"]
        rows.append(
            [
                i,
                r["prompt"],
                r["mean"],
                f"[{lo:.3f}, {hi:.3f}]",
                f"[{b_lo:.3f}, {b_hi:.3f}]",
                r["n"],
                "yes" if r["separated"] else "",
            ]
        )
    table = markdown_table(
        ["rank", "prompt", "mean reward", "95% CI (normal)", "95% CI (bootstrap)", "n", "below best"], rows
    )
    best = result["best"]
    return (
        f"# prompt search: {result['task']} / {result['split']} "
        f"({result['tasks']} tasks, temperature {result['sampling']['temperature']})\n\n"
        f"{table}\n\nbest: `{best}` -> use it with task.prompt={best}\n\n```\n{prompts[best]}\n```"
    )


def run(config: Config, run_dir: Path) -> object:
    """``algo=prompt_search``: what ``agl.jobs.dispatch`` calls."""
    return asyncio.run(run_prompt_search(config, run_dir))
