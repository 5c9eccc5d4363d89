"""Issue 52's measuring campaign: what GRPO itself teaches, apart from the SFT warm-up, on sums, guess the number
and GSM8K; whether dynamic sampling pays; `make demo` and `make run` from a fresh clone.

    PYTHONPATH=. .venv/bin/python bench/rl_gain.py --plan          # the jobs and the time they should take
    flock -x /work/scratch/cpu.lock env PYTHONPATH=. .venv/bin/python bench/rl_gain.py   # every part, in order
    PYTHONPATH=. .venv/bin/python bench/rl_gain.py --parts recipes --tasks sums --seeds 0

Parts (every job a `python harness.py` process of its own, one after another, its run dir under ``--out``; a job
whose run dir says it succeeded is read, not run again, so a stopped campaign goes on where it stopped):
  demo     `make demo` in a fresh clone of HEAD (make setup from the checkout's local wheel caches, an empty
           AGL_CACHE, so the embedded model's conversion is in the time) under /usr/bin/time -v: wall, peak RSS,
           the phases as the job printed them, its final table.
  recipes  each task's default job (conf/task/<task>.yaml's recipe: warm-up, then GRPO), seeds 0-2: base -> after
           the warm-up -> after GRPO on the final eval's problems, each change McNemar-tested; the mean training
           reward of the GRPO steps' first and second halves (issue 52: the second's higher, over 3 seeds).
  alone    GRPO alone (algo.warmup.steps=0, the recipe's GRPO steps), seeds 0-2: base -> after GRPO, the reward
           halves and the 3 seeds' reward curves (bench/results/rl_gain_alone_<task>.png). Sums also with partial
           credit (task.resources.format_bonus=0.1): the base model's samples never earn its 0/1 reward.
  dynamic  dynamic sampling on against off at the same wall time, per task and seed (GSM8K: seed 0 alone): the
           recipe's steps both ways (the recipe's own setting is the recipes part's job), then off again for as
           many steps as the on job's GRPO wall time holds at the off job's step time; the two final evals paired
           on the same problems (McNemar between the jobs, bench/paired_sweep.py's reading).
  run      `make run` (task=gsm8k algo=grpo) in a fresh clone, as demo: within 30 minutes? The warm-up eval's
           phase line is what issue 52's eval after the warm-up costs.

Beside every job: the bf16 and fp32 matmul and the memory bandwidth probes before and after it, the CPU, the
commit. Writes bench/results/rl_gain.json (every job's record) and bench/results/rl_gain.md. Run it alone on the
machine: its wall times are figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from bench.common import RESULTS, ROOT, cpu, matmul_probe

TASKS = ("sums", "guess_number", "gsm8k")
PARTS = ("demo", "recipes", "alone", "dynamic", "run")
# The tables' 0/1 scores (guess the number's reward was its 0/1 win before task.resources.search_bonus; a job's row
# shows those its final table has)
SCORES = {"sums": ["correct"], "guess_number": ["won", "reward"], "gsm8k": ["correct", "format"]}
DYNAMIC_SEEDS = {"gsm8k": 1}  # the dynamic part's seeds per task, at most (GSM8K's three jobs take ~1.5 h a seed)
# Minutes a job takes on the 2-core AMX Xeon with nothing beside it (--plan's estimate): the wall times measured there
# (bench/results/rl_gain.md; guess the number's recipe jobs took 14-18 min, its alone jobs not yet run at 20 steps)
MINUTES = {
    ("sums", "recipe"): 3,
    ("sums", "alone"): 3,
    ("guess_number", "recipe"): 20,
    ("guess_number", "alone"): 20,
    ("gsm8k", "recipe"): 27,
    ("gsm8k", "alone"): 35,
}
FRESH = {"demo": 4, "run": 28}  # the same from a fresh clone, setup and the model's conversion included


def probes() -> dict:
    """The machine's state beside a figure: bf16 and fp32 matmul GFLOP/s, memory read GB/s. No bf16 probe on a CPU
    without native bf16 (an AVX2 machine: its jobs run in float32, and a bf16 matmul there takes minutes)."""
    import torch

    from agl.policy.load import cpu_has_native_bf16
    from bench.serve import memory_probe

    return {
        "bf16_gflops": round(matmul_probe(torch.bfloat16), 1) if cpu_has_native_bf16() else None,
        "fp32_gflops": round(matmul_probe(torch.float32), 1),
        "memory_gb_s": round(memory_probe(), 1),
    }


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return head.stdout.strip()


# ----------------------------------------------------------------------------- one job and what it computed


def job(out: Path, name: str, args: list[str]) -> dict:
    """``python harness.py *args`` into ``out/name`` (read, not run, when its status.json says succeeded), with
    probes before and after; its record (``read_run``)."""
    run_dir = out / name
    status = run_dir / "status.json"
    if not (status.is_file() and json.loads(status.read_text()).get("status") == "succeeded"):
        before, started = probes(), time.perf_counter()
        with open(out / f"{name}.log", "w") as log:
            proc = subprocess.run(
                [sys.executable, "harness.py", *args, "progress=false", f"hydra.run.dir={run_dir}"],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed: see {out / f'{name}.log'}")
        keep_timing(run_dir, round(time.perf_counter() - started, 1), before)
    log = out / f"{name}.log"
    return {"name": name, "args": args, **read_run(run_dir, log.read_text() if log.is_file() else "")}


def keep_timing(run_dir: Path, wall_s: float, before: dict) -> None:
    """A finished job's wall time, the probes before and after it, and the CPU, beside its run (``read_run``)."""
    (run_dir / "rl_gain.json").write_text(json.dumps({"wall_s": wall_s, "probes": [before, probes()], "cpu": cpu()}))


def read_run(run_dir: Path, printed: str) -> dict:
    """A finished run's figures from its files and what it printed: the phases' times, each GRPO step's mean reward
    and informative share, the GRPO steps' wall time, and the final table (``final_table``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in rows if r.get("stage") == "grpo"]
    rewards = [r["reward_mean"] for r in grpo]
    half = len(rewards) // 2
    timing = run_dir / "rl_gain.json"
    return {
        **(json.loads(timing.read_text()) if timing.is_file() else {}),
        "phases": dict(re.findall(r"phase \d+ of \d+ done, ([^:]+): (.+?) \(estimated", printed)),
        "grpo_s": round(sum(r["time_rollout_s"] + r["time_update_s"] + r["time_other_s"] for r in grpo), 1),
        "rewards": rewards,
        "informative_share": [r.get("informative_share") for r in grpo],
        "reward_halves": [mean(rewards[:half]), mean(rewards[-half:])] if half else None,
        "table": final_table(rows),
    }


def final_table(rows: list[dict]) -> dict:
    """{score: {base, end, change[, warm, warm_change, rl_change]}} of the end eval (``eval_all/`` where the
    periodic evals take a slice), each change as [gained, lost, McNemar p]; warm: at the warm-up's end."""
    base = next(r for r in rows if r["step"] == -1)
    last = next(r for r in reversed(rows) if any(k.endswith("_gained") for k in r))
    warm = next((r for r in reversed(rows) if r.get("stage") == "sft"), None)
    prefix = "eval_all/" if any(k.startswith("eval_all/") for k in last) else "eval/"
    table = {}
    for key in (k[: -len("_gained")] for k in last if k.startswith(prefix) and k.endswith("_gained")):
        if key.endswith("_rl"):
            continue
        entry = {"base": base.get(key), "end": last[key], "change": [last[f"{key}{s}"] for s in CHANGE]}
        if warm is not None and f"{key}_rl_p" in last:
            entry |= {
                "warm": warm.get(key),
                "warm_change": [warm.get(f"{key}{s}") for s in CHANGE],
                "rl_change": [last[f"{key}_rl{s}"] for s in CHANGE],
            }
        table[key[len(prefix) :]] = entry
    return table


CHANGE = ("_gained", "_lost", "_p")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


# ----------------------------------------------------------------------------- the parts


def fresh_clone(out: Path, target: str) -> dict:
    """``make <target>`` in a fresh clone of HEAD with an empty AGL_CACHE and eval cache, under /usr/bin/time -v."""
    clone, cache = Path(tempfile.mkdtemp(prefix=f"agl-{target}-")), Path(tempfile.mkdtemp(prefix="agl-cache-"))
    try:
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        if (ROOT / ".wheels").is_dir():  # make setup's local caches (torch's wheel, uv): not the network's speed
            shutil.copytree(ROOT / ".wheels", clone / ".wheels", symlinks=True)
        before, started = probes(), time.perf_counter()
        proc = subprocess.run(
            ["/usr/bin/time", "-v", "make", target, "RUN_ARGS=task=gsm8k algo=grpo progress=false"],
            cwd=clone,
            capture_output=True,
            text=True,
            env={**os.environ, "AGL_CACHE": str(cache), "AGL_EVAL_CACHE": str(cache / "evals")},
        )
        wall = round(time.perf_counter() - started, 1)
        (out / f"make_{target}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"make {target} failed: see {out / f'make_{target}.log'}")
        peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        run_dir = Path(re.search(r"run dir: (\S+)", proc.stdout).group(1))
        if not run_dir.is_absolute():
            run_dir = clone / run_dir
        kept = out / f"make_{target}"  # the run dir outlives the clone
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(run_dir, kept)
        keep_timing(kept, wall, before)
        return {
            "name": f"make {target}",
            "peak_rss_kib": int(peak.group(1)) if peak else None,
            "printed_table": proc.stdout[proc.stdout.index("base model") :].split("\n\nreport:")[0],
            **read_run(kept, proc.stdout + proc.stderr),
        }
    finally:
        shutil.rmtree(clone, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


def recipes(out: Path, tasks: list[str], seeds: list[int]) -> list[dict]:
    """Each task's default job per seed. ``make run`` is GSM8K's at seed 0 (``task=gsm8k algo=grpo``, the default
    seed): where the run part has finished, its run dir stands for that job (wall time with setup and conversion)."""
    records, made = [], out / "make_run"
    for t in tasks:
        for s in seeds:
            args = [f"task={t}", "algo=grpo", f"seed={s}"]
            if (t, s) == ("gsm8k", 0) and (made / "status.json").is_file():
                printed = (out / "make_run.log").read_text()
                records.append({"name": "make run (recipe_gsm8k_s0)", "args": args, **read_run(made, printed)})
            else:
                records.append(job(out, f"recipe_{t}_s{s}", args))
    return records


def alone(out: Path, tasks: list[str], seeds: list[int]) -> list[dict]:
    from agl.report.plots import draw_panels

    records = []
    for t in tasks:
        variants = [("", [])] + ([("_format_bonus", ["task.resources.format_bonus=0.1"])] if t == "sums" else [])
        for suffix, extra in variants:
            for s in seeds:
                args = [f"task={t}", "algo=grpo", f"seed={s}", "algo.warmup.steps=0", *extra]
                records.append(job(out, f"alone_{t}{suffix}_s{s}", args))
            runs = {f"seed {s}": read_metrics(out / f"alone_{t}{suffix}_s{s}") for s in seeds}
            title = f"{t}: training reward of GRPO alone" + (" (format bonus)" if suffix else "")
            draw_panels(runs, RESULTS / f"rl_gain_alone_{t}{suffix}.png", [(title, ["reward_mean"])])
    return records


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def recipe_has_dynamic_sampling(task: str) -> bool:
    from omegaconf import OmegaConf

    return bool(OmegaConf.load(ROOT / "conf" / "task" / f"{task}.yaml").get("recipe", {}).get("dynamic_sampling"))


def dynamic(out: Path, tasks: list[str], seeds: list[int]) -> list[dict]:
    from bench.paired_sweep import Job
    from bench.paired_sweep import change as paired

    records = []
    for t in tasks:
        for s in seeds[: DYNAMIC_SEEDS.get(t, len(seeds))]:
            base = [f"task={t}", "algo=grpo", f"seed={s}"]
            on_args, off_args = [*base, "algo.dynamic_sampling=true"], [*base, "algo.dynamic_sampling=false"]
            if recipe_has_dynamic_sampling(t):  # the recipes part's job is one of the two
                on, off = job(out, f"recipe_{t}_s{s}", base), job(out, f"dynamic_{t}_s{s}_off", off_args)
            else:
                on, off = job(out, f"dynamic_{t}_s{s}_on", on_args), job(out, f"recipe_{t}_s{s}", base)
            steps = len(off["rewards"])
            same_time = max(steps, round(on["grpo_s"] / max(off["grpo_s"] / steps, 1e-9)))
            longer = off
            if same_time > steps:
                longer = job(out, f"dynamic_{t}_s{s}_off_{same_time}_steps", [*off_args, f"algo.steps={same_time}"])
            score = SCORES[t][0]
            on_final = asyncio.run(Job.read(out / on["name"], [score])).final
            off_final = asyncio.run(Job.read(out / longer["name"], [score])).final
            record = {"task": t, "seed": s, "on": on, "off": off, "off_same_time": longer}
            records.append(record | {"on_vs_off_same_time": paired(off_final, on_final)})
    return records


# ----------------------------------------------------------------------------- the report


def change(c: list | None) -> str:
    return f"+{int(c[0])} −{int(c[1])}, p = {c[2]:.2g}" if c and c[0] is not None else ""


def rate(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def probe_cell(record: dict) -> str:
    bf16 = lambda p: "–" if p["bf16_gflops"] is None else f"{p['bf16_gflops']:.0f}"  # noqa: E731 (no bf16: AVX2)
    cells = (f"{bf16(p)}, {p['fp32_gflops']:.0f}, {p['memory_gb_s']:.1f}" for p in record["probes"])
    return " / ".join(cells)


def kind(record: dict) -> str:
    """The job's CPU kind (amx_bf16, avx512_bf16, avx2): its dtype and its speed's class."""
    return record["cpu"].split(", ")[1] if "cpu" in record else ""


def task_of(record: dict) -> str:
    return next(a.split("=", 1)[1] for a in record.get("args", ["task=gsm8k"]) if a.startswith("task="))


def write_report(results: dict) -> None:
    from agl.report.tables import markdown_table

    lines = [
        "# Issue 52's campaign: what GRPO teaches apart from the warm-up",
        "",
        f"Last written on {results['cpu']} at commit {results['commit']}, {results['date']}, by bench/rl_gain.py. "
        "Each job's CPU kind is in its row (AVX2: float32 compute). Probes before / after each job: bf16 and fp32 "
        "matmul GFLOP/s (no bf16 on AVX2: –), memory read GB/s.",
        "",
    ]
    for target in ("demo", "run"):
        if record := results.get(target):
            lines += [
                f"## make {target}, fresh clone",
                "",
                f"{kind(record)}: wall **{record['wall_s']} s**, peak RSS {record['peak_rss_kib']} KiB, probes "
                f"{probe_cell(record)}; "
                "phases: " + ", ".join(f"{k} {v}" for k, v in record["phases"].items()),
                "",
                "```text",
                record["printed_table"],
                "```",
                "",
            ]
    rows = []
    for record in [*results.get("recipes", []), *results.get("alone", [])]:
        for score in (s for s in SCORES[task_of(record)] if s in record["table"]):
            t = record["table"][score]
            rows.append(
                [
                    record["name"],
                    score,
                    rate(t.get("base")),
                    rate(t.get("warm")),
                    rate(t.get("end")),
                    change(t.get("warm_change")),
                    change(t.get("rl_change") if "warm" in t else t.get("change")),
                    " -> ".join(f"{x:.3f}" for x in record["reward_halves"] or []),
                    record.get("wall_s", ""),
                    kind(record),
                    probe_cell(record) if record.get("probes") else "",
                ]
            )
    if rows:
        headers = ["job", "score", "base", "after warm-up", "end", "warm-up's change", "GRPO's change"]
        headers += ["train reward, 1st half -> 2nd half", "wall s", "CPU", "probes"]
        lines += ["## jobs", "", markdown_table(headers, rows), ""]
    rows = []
    for d in results.get("dynamic", []):
        score = SCORES[d["task"]][0]
        for label in ("on", "off", "off_same_time"):
            r, t = d[label], d[label]["table"].get(score, {})
            rows.append(
                [
                    f"{d['task']} s{d['seed']}",
                    label,
                    len(r["rewards"]),
                    r["grpo_s"],
                    rate(t.get("end")),
                    change(t.get("rl_change") or t.get("change")),
                    d["on_vs_off_same_time"] if label == "off_same_time" else "",
                    " ".join(f"{x:.2f}" for x in r["informative_share"]),
                ]
            )
    if rows:
        headers = ["task, seed", "dynamic sampling", "GRPO steps", "GRPO s", "end", "GRPO's change"]
        headers += ["on against off, same time (McNemar)", "informative share by step"]
        lines += ["## dynamic sampling, on against off", "", markdown_table(headers, rows), ""]
    (RESULTS / "rl_gain.md").write_text("\n".join(lines) + "\n")


def print_plan(parts: list[str], tasks: list[str], seeds: list[int]) -> None:
    total = 0.0
    for part in parts:
        if part in FRESH:
            minutes = FRESH[part]
        elif part == "dynamic":  # off (or on) beside the recipes' job, then off again for about the on job's time
            minutes = sum(2 * MINUTES[(t, "recipe")] * len(seeds[: DYNAMIC_SEEDS.get(t, len(seeds))]) for t in tasks)
        elif part == "alone":
            minutes = sum(MINUTES[(t, "alone")] * (2 if t == "sums" else 1) for t in tasks) * len(seeds)
        else:
            minutes = sum(MINUTES[(t, "recipe")] for t in tasks) * len(seeds)
        total += minutes
        print(f"{part:8s} ~{minutes:.0f} min")
    print(f"total    ~{total / 60:.1f} h, both cores")


def merged(before: dict | list | None, now: dict | list) -> dict | list:
    """A part's records after a run of some of its tasks and seeds: the new ones in place of their namesakes, the
    others kept, so that a campaign run a task at a time keeps every task's rows."""
    if not isinstance(now, list) or not isinstance(before, list):
        return now
    key = lambda r: r.get("name") or (r["task"], r["seed"])  # noqa: E731 (a dynamic record has no name)
    fresh = {key(r): r for r in now}
    return [fresh.pop(key(r), r) for r in before] + list(fresh.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "rl_gain")
    parser.add_argument("--plan", action="store_true", help="print the parts and their estimated time, run nothing")
    args = parser.parse_args()
    parts, tasks, seeds = args.parts.split(","), args.tasks.split(","), [int(s) for s in args.seeds.split(",")]
    if unknown := set(parts) - set(PARTS) or set(tasks) - set(TASKS):
        parser.error(f"unknown: {sorted(unknown)}")
    if args.plan:
        print_plan(parts, tasks, seeds)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "rl_gain.json"
    run_part = {
        "demo": lambda: fresh_clone(args.out, "demo"),
        "recipes": lambda: recipes(args.out, tasks, seeds),
        "alone": lambda: alone(args.out, tasks, seeds),
        "dynamic": lambda: dynamic(args.out, tasks, seeds),
        "run": lambda: fresh_clone(args.out, "run"),
    }
    for part in parts:
        records = run_part[part]()
        # read again after the part: a campaign on another core may have written its own parts meanwhile
        results = json.loads(path.read_text()) if path.is_file() else {}
        results |= {"cpu": cpu(), "commit": commit(), "date": str(date.today())}
        results[part] = merged(results.get(part), records)
        path.write_text(json.dumps(results, indent=1) + "\n")
        write_report(results)
    print(f"written: {path}, {RESULTS / 'rl_gain.md'}")


if __name__ == "__main__":
    main()
