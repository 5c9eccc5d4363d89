"""``algo=eval``: score a policy on a split, with no training.

The policy is the base model, or an adapter an earlier run produced
(``model.adapter=<run dir or adapter dir>``, see ``agl.policy.lora.find_adapter_dir``). Greedy by
default; with ``algo.k > 1`` (and ``algo.temperature > 0``) every task is tried k times and
pass@k is reported. The table is printed and written to ``eval.md`` and ``eval.json`` in the
run dir; the rollouts are in the run's store like any other run's, so a killed eval resumes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from agl.config import Config, EvalConfig, ModelConfig
from agl.errors import ConfigError
from agl.eval.evaluate import (
    cached_rows,
    describe_cached,
    evaluate_rows,
    rate_intervals,
    sampling_of,
    split_rows,
    summarize,
)
from agl.eval.failures import rollout_failures
from agl.report.tables import fmt, markdown_table
from agl.runtime import Runtime

log = logging.getLogger(__name__)


def adapter_label(model: ModelConfig) -> str:
    if not model.adapter:
        return "none (base model)"
    from agl.policy.lora import find_adapter_dir

    return str(find_adapter_dir(model.adapter))


async def run_eval(config: Config, run_dir: Path) -> dict:
    algo: EvalConfig = config.algo
    if algo.k < 1:
        raise ConfigError(f"algo.k must be >= 1, got {algo.k}")
    if algo.k > 1 and algo.temperature == 0:
        log.warning("algo.k=%d with algo.temperature=0: greedy tries are identical, so pass@k = pass@1", algo.k)
    adapter = adapter_label(config.model)
    async with Runtime.of(config, run_dir) as rt:
        rows = split_rows(rt.task.load(algo.split), algo.size)
        if not rows:
            raise ConfigError(f"split '{algo.split}' of task '{config.task.name}' has no rows")
        await rt.record_config()
        scores = await evaluate_rows(
            rt,
            rows,
            resources=rt.task.resources_for(algo.prompt),
            sampling=sampling_of(algo),
            k=algo.k,
            tag={"eval": "eval"},
            desc=f"eval {algo.split}",
            split=algo.split,
        )
        summary = summarize(scores, k=algo.k, pass_threshold=algo.pass_threshold)
        failures = await rollout_failures(rt.store, {s["rollout_id"]: s["status"] for s in scores})
        await rt.store.log_metrics(0, {f"eval/{k}": v for k, v in summary.items()})
    result = {
        "task": config.task.name,
        "model": config.model.name,
        "adapter": adapter,
        "split": algo.split,
        "tasks": len(rows),
        "k": algo.k,
        "prompt": algo.prompt,
        "sampling": sampling_of(algo),
        "summary": summary,
        "metrics": {f"eval/{k}": v for k, v in summary.items()},
        "intervals": rate_intervals(scores),
        "cached": cached_rows(scores),
    }
    text = eval_markdown(result)
    if failures.failed:  # the table counts them as reward 0; say how many and why
        text += "\n\n" + failures.describe(f"eval {algo.split}")
    (run_dir / "eval.md").write_text(text + "\n")
    (run_dir / "eval.json").write_text(json.dumps({**result, "rollouts": scores}, indent=1, default=str) + "\n")
    print(text)
    print(f"\nwritten: {run_dir / 'eval.md'}, {run_dir / 'eval.json'}")
    return result


def eval_markdown(result: dict) -> str:
    s = result["sampling"]
    header = (
        f"# eval: {result['task']} / {result['split']} ({result['tasks']} tasks x {result['k']})\n\n"
        f"model {result['model']}, adapter {result['adapter']}, prompt `{result['prompt']}`, "
        f"temperature {s['temperature']}, max_tokens {s['max_tokens']}\n"
    )
    if cached := result.get("cached"):
        header += f"\n{describe_cached(cached, result['tasks'] * result['k'])}\n"
    intervals = result.get("intervals", {})
    rows = [[k, v, _interval(intervals.get(k))] for k, v in result["summary"].items()]
    return header + "\n" + markdown_table(["metric", "value", "95% interval (Wilson, 0/1 scores)"], rows)


def _interval(rate: dict | None) -> str:
    return "" if rate is None else f"[{fmt(rate['lo'])}, {fmt(rate['hi'])}] of {rate['n']}"


def run(config: Config, run_dir: Path) -> object:
    """``algo=eval``: what ``agl.jobs.dispatch`` calls."""
    return asyncio.run(run_eval(config, run_dir))
