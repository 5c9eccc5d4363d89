"""``python harness.py report=<run dir or sweep dir>``: what happened in a run, from its files alone.

A run dir's ``store.sqlite`` is read through one read-only connection in one snapshot (safe
next to a live run; its views, see agl/store/schema.sql) and its ``metrics.jsonl`` read; no
model is loaded. Printed (and written to
``report.md``): the run summary, the best step, reward and accuracy by step, the slowest
rollouts, failure counts by error; ``curves.png`` is redrawn. A sweep dir gets the sweep
summary instead (``agl.report.sweep.write_sweep_summary``).

Attempts cut short by the end of the harness (killed, or closed with work in flight) are
not the agent's failures and used no retry (rule R7 in agl/store/rules.py): they are
counted apart from retries, and listed apart from the agent's errors.
"""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

from agl.errors import ConfigError
from agl.report.plots import draw_panels, read_metrics
from agl.report.status import effective_status, read_status
from agl.report.sweep import is_sweep_dir, write_sweep_summary
from agl.report.tables import RL, change, fmt, is_derived, markdown_table, paired_scores, vs_base, with_interval
from agl.store import db

SLOWEST = 5
SAMPLES = 5  # eval tasks whose replies before and after training report.md quotes
ACCURACY_HINTS = ("correct", "accuracy", "says_", "pass@", "format", "not_last")
EVAL_NAME = (  # SQL: the eval a rollout belongs to, as the report names it (NULL: not an eval's)
    "CASE WHEN json_extract(metadata, '$.eval_step') IS NOT NULL THEN 'eval@' || json_extract(metadata, '$.eval_step') "
    "WHEN json_extract(metadata, '$.eval') IS NOT NULL THEN 'eval ' || json_extract(metadata, '$.eval') "
    "WHEN json_extract(metadata, '$.candidate') IS NOT NULL THEN 'prompt ' || json_extract(metadata, '$.candidate') "
    "END"
)
HARNESS_ENDS = {  # attempts.metadata.harness_ended -> how the failures table shows them
    "dead": "the harness died (not the agent's failure: rerun, no retry used)",
    "closed": "the harness closed with it in flight (not the agent's failure: rerun, no retry used)",
}


def report(target: str | Path) -> dict:
    path = Path(str(target)).expanduser()
    if not path.exists():
        raise ConfigError(f"report='{target}' does not exist")
    if not path.is_dir():
        raise ConfigError(f"report='{target}' is not a directory")
    if (path / "store.sqlite").is_file():
        return report_run(path)
    if is_sweep_dir(path):
        return write_sweep_summary(path)
    raise ConfigError(f"report='{target}' is neither a run dir (no store.sqlite) nor a sweep dir (no job dirs)")


def report_run(run_dir: Path, echo: bool = True, status: str | None = None, draw: bool = True) -> dict:
    """Write (and with ``echo`` print) report.md and curves.png from a run dir's files. ``status``: the run's
    status when the caller knows it better than status.json (a job writing its report as it ends); ``draw``:
    False when curves.png is already drawn from the same metrics (the trainer draws it as it returns)."""
    data = _read_store(run_dir / "store.sqlite")
    rows = read_metrics(run_dir / "metrics.jsonl")
    if not rows and data["metrics"]:  # no metrics.jsonl (e.g. deleted): the store has them too
        rows = [{"step": step, **values} for step, values in sorted(data["metrics"].items())]
    sections = [
        ("run", _run_section(run_dir, data, rows, status)),
        ("best step", _best_section(rows)),
        ("reward and accuracy by step", _by_step_section(rows, data["step_summary"])),
        *([("change against the base model", vs)] if (vs := _vs_base_section(rows)) else []),
        *([("rows from the eval cache", cached)] if (cached := _cached_section(data["cached"])) else []),
        *(
            [(f"samples: the same eval tasks before and after training (first {SAMPLES})", samples)]
            if (samples := _samples_section(data["eval_replies"] + data["cached_replies"]))
            else []
        ),
        (f"slowest rollouts (top {SLOWEST})", _slowest_section(data["slowest"])),
        ("failures by error", _failures_section(data["failures"], data["harness_ends"])),
    ]
    plot = run_dir / "curves.png"
    if rows and draw:
        draw_panels({"run": rows}, plot)
    text = "\n\n".join(f"## {title}\n\n{body}" for title, body in sections)
    text = f"# report: {run_dir}\n\n{text}\n\nplots: {plot if plot.exists() else '(no metrics to plot)'}\n"
    (run_dir / "report.md").write_text(text)
    if echo:
        print(text)
    return {
        "run_dir": str(run_dir),
        "sections": [t for t, _ in sections],
        "data": {k: v for k, v in data.items() if k != "metrics"},
    }


def _read_store(path: Path) -> dict:
    """What the report shows from the store: one snapshot, through a read-only connection
    (no store session is opened, nothing is written)."""
    conn = db.connect(path, readonly=True, busy_timeout=30.0, synchronous="NORMAL")
    try:
        return _snapshot(conn)
    except sqlite3.DatabaseError as error:
        if db.is_damage(error):
            raise db.StoreDamaged(path, str(error)) from None
        raise
    finally:
        conn.close()


def _snapshot(conn: sqlite3.Connection) -> dict:
    """The report's reads, in one read transaction."""
    db.check_schema(conn)
    q = lambda sql: [tuple(r) for r in conn.execute(sql).fetchall()]  # noqa: E731
    with db.read_transaction(conn):
        data = {
            "rollouts_by_status": q("SELECT status, count(*) FROM rollouts GROUP BY status ORDER BY count(*) DESC"),
            "rollouts_by_mode": q("SELECT coalesce(mode, '-'), count(*) FROM rollouts GROUP BY mode ORDER BY mode"),
            # all attempts; retries = charged attempts beyond each rollout's first; harness-ended ones
            "attempts": q(
                "SELECT count(*), "
                "coalesce(sum(charged), 0) - count(DISTINCT CASE WHEN charged THEN rollout_id END), "
                "coalesce(sum(NOT charged), 0) FROM (SELECT rollout_id, "
                "json_extract(metadata, '$.harness_ended') IS NULL AS charged FROM attempts)"
            )[0],
            "llm_calls": q("SELECT count(*), coalesce(sum(response_tokens), 0), avg(latency) FROM llm_calls")[0],
            "time_span": q("SELECT min(start_time), max(end_time) FROM rollouts")[0],
            "step_summary": q(
                "SELECT step, rollouts, succeeded, failed, unfinished, retried FROM step_summary ORDER BY step"
            ),
            "slowest": q(
                "SELECT d.rollout_id, r.mode, CASE WHEN r.step IS NOT NULL THEN 'step ' || r.step "
                "WHEN json_extract(r.metadata, '$.eval_step') IS NOT NULL "
                "THEN 'eval@' || json_extract(r.metadata, '$.eval_step') "
                "WHEN json_extract(r.metadata, '$.candidate') IS NOT NULL "
                "THEN 'prompt ' || json_extract(r.metadata, '$.candidate') "
                "ELSE '' END, d.sequence_id, d.status, d.duration, d.spans, rr.reward "
                "FROM attempt_durations d JOIN rollouts r ON r.rollout_id = d.rollout_id "
                "LEFT JOIN rollout_rewards rr ON rr.rollout_id = d.rollout_id "
                f"WHERE d.duration IS NOT NULL ORDER BY d.duration DESC LIMIT {SLOWEST}"
            ),
            "failures": q(
                "SELECT status, coalesce(json_extract(metadata, '$.error'), '(no error recorded)') AS error, "
                "count(*) "
                "FROM attempts WHERE status NOT IN ('succeeded', 'preparing', 'running') "
                "AND json_extract(metadata, '$.harness_ended') IS NULL "
                "GROUP BY status, error ORDER BY count(*) DESC"
            ),
            "harness_ends": q(
                "SELECT status, json_extract(metadata, '$.harness_ended') AS how, count(*) FROM attempts "
                "WHERE json_extract(metadata, '$.harness_ended') IS NOT NULL "
                "GROUP BY status, how ORDER BY count(*) DESC, how"
            ),
            "eval_replies": q(
                "SELECT json_extract(r.metadata, '$.eval_step') AS at, json_extract(r.metadata, '$.task_id'), "
                "r.input, "
                "json_extract(s.attributes, '$.response_text'), rr.reward FROM rollouts r "
                "JOIN latest_attempts la ON la.rollout_id = r.rollout_id "
                "JOIN spans s ON s.attempt_id = la.attempt_id AND s.name LIKE 'llm.%' "
                # the policy's replies, not a frozen helper's"
                "AND coalesce(json_extract(s.attributes, '$.trainable'), 1) != 0 "
                "LEFT JOIN rollout_rewards rr ON rr.rollout_id = r.rollout_id "
                "WHERE at IS NOT NULL ORDER BY r.seq, s.sequence_id"
            ),
            # evals' rows the eval cache supplied (agl/eval/cache.py): no attempt, no span; the reply is kept
            "cached_replies": q(
                "SELECT json_extract(metadata, '$.eval_step') AS at, json_extract(metadata, '$.task_id'), input, "
                "json_extract(metadata, '$.cached.reply'), json_extract(metadata, '$.cached.score.reward') "
                "FROM rollouts WHERE at IS NOT NULL AND json_extract(metadata, '$.cached') IS NOT NULL ORDER BY seq"
            ),
            "cached": q(
                f"SELECT {EVAL_NAME} AS ev, count(*), "
                "sum(json_extract(metadata, '$.cached.kind') = 'exact'), "
                "sum(json_extract(metadata, '$.cached.kind') = 'sample') "
                "FROM rollouts WHERE ev IS NOT NULL GROUP BY ev "
                "HAVING count(json_extract(metadata, '$.cached')) > 0 ORDER BY min(seq)"
            ),
        }
        data["checkpoints"] = q("SELECT step, policy_version FROM checkpoints ORDER BY step")
        data["metrics"] = {}
        for row in conn.execute("SELECT step, name, value FROM metrics ORDER BY step, name"):
            data["metrics"].setdefault(row["step"], {})[row["name"]] = row["value"]
        config = conn.execute("SELECT value FROM run_info WHERE key = 'config'").fetchone()
        data["config"] = None if config is None else json.loads(config["value"])
    return data


def _run_section(run_dir: Path, data: dict, rows: list[dict], status_now: str | None) -> str:
    config = data.get("config") or {}
    if not config and (run_dir / ".hydra" / "config.yaml").is_file():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"))
    status = read_status(run_dir)
    if status and status_now:
        status = {**status, "status": status_now}
    algo, task, model = config.get("algo") or {}, config.get("task") or {}, config.get("model") or {}
    checkpoints = data["checkpoints"]
    calls, tokens, latency = data["llm_calls"]
    start, end = data["time_span"]
    items = [
        (
            "status",
            effective_status(status) + (f" ({status['error']})" if status and status.get("error") else "")
            if status
            else "(no status.json)",
        ),
        ("algo", algo.get("name") + (f" ({algo['fn']})" if algo.get("fn") else "") if algo else None),
        (
            "task",
            f"{task.get('name')} (prompt {task.get('prompt')})" if task and algo.get("name") != "serve" else None,
        ),  # serve runs no task
        ("model", f"{model.get('name')}" + (f", adapter {model['adapter']}" if model.get("adapter") else "")),
        (
            "steps",
            f"{checkpoints[-1][0] + 1} of {_planned_steps(algo)} done, policy version {checkpoints[-1][1]}"
            if checkpoints
            else None
            if algo.get("name") in ("eval", "prompt_search", "custom", "serve")
            else "no checkpoint yet",
        ),
        ("rollouts", ", ".join(f"{n} {s}" for s, n in data["rollouts_by_status"]) or "none"),
        ("by mode", ", ".join(f"{n} {m}" for m, n in data["rollouts_by_mode"]) or "none"),
        (
            "attempts",
            "{} ({} retries after agent failures, {} interrupted by the harness dying or closing)".format(
                *data["attempts"]
            ),
        ),
        ("llm calls", f"{calls} calls, {tokens} tokens" + (f", {latency:.3f} s mean latency" if latency else "")),
        ("wall time", f"{end - start:.1f} s of rollouts" if start and end else None),
    ]
    result = (status or {}).get("result")
    if algo.get("name") == "custom":  # the user's function returned it: show it as it is, on one line
        items.append(("result", _first_line(json.dumps(result), limit=300)))
    elif isinstance(result, dict):
        if "summary" in result:
            items.append(("eval", ", ".join(f"{k} {fmt(v)}" for k, v in result["summary"].items())))
        if "best" in result:
            items.append(("best prompt", f"{result['best']} ({fmt(result['ranking'][0]['mean'])})"))
    return markdown_table(["", ""], [(k, v) for k, v in items if v is not None])


def _planned_steps(algo: dict) -> str:
    """A GRPO job's steps, with its SFT warm-up's in front (epochs-based warm-ups are not counted ahead)."""
    warmup = (algo.get("warmup") or {}).get("steps") or 0
    return (
        f"{warmup + algo.get('steps')} ({warmup} SFT warm-up + {algo.get('steps')} GRPO)"
        if warmup
        else str(algo.get("steps"))
    )


def _metric_key(rows: list[dict]) -> str | None:
    for key in ("eval/reward", "reward_mean", "loss"):
        if any(isinstance(r.get(key), (int, float)) for r in rows):
            return key
    return None


def _best_section(rows: list[dict]) -> str:
    key = _metric_key(rows)
    if key is None:
        return "(no metrics)"
    points = [r for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    pick = min if key == "loss" else max
    best = pick(points, key=lambda r: r[key])
    extra = ", ".join(f"{k} {fmt(best[k])}" for k in ("reward_mean", "eval/reward", "loss") if k in best and k != key)
    return (
        f"step {best['step']}: {key} {fmt(best[key])}"
        + (f" ({extra})" if extra else "")
        + (" [step -1 = before training]" if best["step"] == -1 else "")
    )


def _by_step_section(rows: list[dict], step_summary: list[tuple]) -> str:
    if not rows:
        return "(no metrics)"
    keys = [
        k
        for k in ("reward_mean", "informative_share", "rollouts_failed", "loss", "sft_loss", "eval/reward")
        if any(k in r for r in rows)
    ]
    keys += sorted(
        {
            k
            for r in rows
            for k in r
            if k.startswith(("eval/", "eval_all/")) and any(h in k for h in ACCURACY_HINTS) and not is_derived(r, k)
        }
    )
    failed = {s: f for s, _, _, f, _, _ in step_summary}
    table = [[r["step"], *[with_interval(r, k) for k in keys]] for r in rows]
    if failed and "rollouts_failed" not in keys:
        keys.append("failed (store)")
        table = [row + [failed.get(row[0])] for row in table]
    return markdown_table(["step", *keys], table)


def _last_paired(rows: list[dict]) -> dict | None:
    """The last row with an eval paired with the baseline's."""
    return next((r for r in reversed(rows) if paired_scores(r)), None)


def _vs_base_section(rows: list[dict]) -> str | None:
    """The last eval's 0/1 scores against the baseline's, on the same tasks (McNemar's exact test), and, after a
    warm-up, against the eval where GRPO began."""
    last = _last_paired(rows)
    if last is None:
        return None
    keys = paired_scores(last)
    rl = any(f"{k}{RL}_p" in last for k in keys)
    table = [[k, with_interval(last, k), vs_base(last, k), *([vs_base(last, k, RL)] if rl else [])] for k in keys]
    headers = ["score", "rate [95% Wilson]", "base -> now (tasks gained, lost; McNemar exact p)"]
    headers += ["after the warm-up -> now (GRPO's own change)"] if rl else []
    title = f"step {last['step']} against the baseline (step -1), same tasks, greedy:"
    return f"{title}\n\n" + markdown_table(headers, table)


def learning_table(rows: list[dict]) -> str | None:
    """What a training job learned, for the terminal at its end: each 0/1 score of its last eval against the
    baseline's on the same tasks (the whole end eval, ``eval_all/``, where the periodic ones cover a slice),
    both with 95% Wilson intervals, the tasks gained and lost, McNemar's exact p. After an SFT warm-up, the eval
    at its end (the same tasks) stands between them: the warm-up's change and GRPO's own, each tested apart."""
    base = next((r for r in rows if r.get("step") == -1), None)
    last = _last_paired(rows)
    if base is None or last is None:
        return None
    keys = paired_scores(last)
    if any(k.startswith("eval_all/") for k in keys):
        keys = [k for k in keys if k.startswith("eval_all/")]
    n = int(last.get(keys[0].split("/")[0] + "/n", 0)) if keys else 0
    warm = next((r for r in reversed(rows) if r.get("stage") == "sft"), None)
    if warm is not None and any(f"{k}{RL}_p" in last for k in keys):
        return _phases_table(base, warm, last, keys, n)
    table = [
        [
            k.split("/", 1)[1],
            with_interval(base, k),
            with_interval(last, k),
            int(last[f"{k}_gained"]),
            int(last[f"{k}_lost"]),
            last[f"{k}_p"],
        ]
        for k in keys
    ]
    return f"base model vs after {last['step'] + 1} steps, the same {n} tasks, greedy:\n\n" + markdown_table(
        ["score", "base [95% Wilson]", "after [95% Wilson]", "gained", "lost", "McNemar exact p"], table
    )


def _phases_table(base: dict, warm: dict, last: dict, keys: list[str], n: int) -> str:
    """base -> after the warm-up -> after GRPO, each score's three rates and the change of each phase."""
    steps = lambda n: f"{n} step" + ("s" if n != 1 else "")  # noqa: E731
    table = [
        [
            k.split("/", 1)[1],
            with_interval(base, k),
            with_interval(warm, k) if k in warm else last[f"{k}{RL}_base"],
            with_interval(last, k),
            change(warm, k) if f"{k}_p" in warm else None,
            change(last, k + RL),
            change(last, k),
        ]
        for k in keys
        if f"{k}{RL}_p" in last
    ]
    headers = ["score", "base", "after warm-up", "after GRPO", "warm-up's change", "GRPO's change", "whole job"]
    return (
        f"base model -> after the SFT warm-up ({steps(warm['step'] + 1)}) -> after GRPO "
        f"({steps(last['step'] - warm['step'])}), the same {n} "
        "tasks, greedy; rates [95% Wilson], changes as tasks +gained -lost, McNemar exact p:\n\n"
        + markdown_table(headers, table)
    )


def _cached_section(cached: list[tuple]) -> str | None:
    """Which evals' rows the eval cache supplied instead of running them, and of which kind (agl/eval/cache.py)."""
    if not cached:
        return None
    table = [[ev, n, exact or 0, sample or 0, n - (exact or 0) - (sample or 0)] for ev, n, exact, sample in cached]
    return (
        "exact: computed by a batch-invariant engine, replayed bit for bit; sample: computed batched (bf16), an "
        "equally valid sample of the same eval, not its replay (eval_cache.reuse=exact reuses exact rows only)\n\n"
        + markdown_table(["eval", "rows", "exact from the cache", "sample from the cache", "run here"], table)
    )


def _samples_section(replies: list[tuple], count: int = SAMPLES) -> str | None:
    """The same eval tasks' replies (the last LLM call of each) before training and after the last eval."""
    by_step: dict[int, dict] = {}
    for at, task, task_input, text, reward in replies:
        by_step.setdefault(at, {})[task] = (task_input, text, reward)  # a later call of the rollout replaces
    if 0 not in by_step or len(by_step) < 2:
        return None
    last = max(by_step)
    tasks = [t for t in by_step[0] if t in by_step[last]][:count]
    blocks = []
    for task in tasks:
        task_input, before, reward_before = by_step[0][task]
        _, after, reward_after = by_step[last][task]
        blocks.append(
            f"### {task}\n\n{_question(task_input)}\n\nbefore training (reward {fmt(reward_before)}):\n\n"
            f"{quote(before)}\n\nafter {last} updates (reward {fmt(reward_after)}):\n\n{quote(after)}"
        )
    return "\n\n".join(blocks)


def _question(task_input: str | None) -> str:
    row = json.loads(task_input) if task_input else {}
    text = row.get("question") if isinstance(row, dict) else None
    return quote(text if isinstance(text, str) else json.dumps(row)[:500])


def quote(text: str | None) -> str:
    """``text`` as a Markdown block quote, as report.md shows a task or a reply."""
    return "\n".join("> " + line for line in (text or "(no reply)").splitlines() or [""])


def _slowest_section(slowest: list[tuple]) -> str:
    if not slowest:
        return "(no finished attempts)"
    rows = [
        [rid, mode, step, attempt, status, duration, spans, reward]
        for rid, mode, step, attempt, status, duration, spans, reward in slowest
    ]
    return markdown_table(["rollout", "mode", "of", "attempt", "status", "seconds", "spans", "reward"], rows)


def _failures_section(failures: list[tuple], harness_ends: list[tuple]) -> str:
    """The agent's failures by error, most frequent first, then the harness's ends."""
    if not failures and not harness_ends:
        return "no failed attempts"
    merged: dict[tuple[str, str], int] = {}
    for status, error, n in failures:  # errors that differ only after their first line count together
        key = (status, _first_line(error))
        merged[key] = merged.get(key, 0) + n
    rows = sorted(([s, e, n] for (s, e), n in merged.items()), key=lambda r: -r[2])
    rows += [[status, HARNESS_ENDS.get(how, f"the harness ended ({how})"), n] for status, how, n in harness_ends]
    return markdown_table(["status", "error", "attempts"], rows)


def _first_line(text: str, limit: int = 120) -> str:
    line = str(text).strip().splitlines()[0] if str(text).strip() else str(text)
    return line if len(line) <= limit else line[: limit - 3] + "..."


if __name__ == "__main__":  # python -m agl.report.run_report <dir>
    import sys

    report(sys.argv[1])
