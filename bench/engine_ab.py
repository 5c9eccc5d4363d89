"""The engine on an eval-like workload, two checkouts (or malloc settings) side by side.

Workload: ``--clients`` concurrent clients each submit GSM8K test prompts (the task's cot
prompt, chat-rendered) one after another straight to the engine, greedy, ``ignore_eos``, with
``max_tokens`` drawn per request from a seeded uniform over [``--min-tokens``, ``--max-tokens``]:
rows finish at scattered steps and new prompts take their places, as in the default job's evals,
where the base model writes until max_tokens more often than not. The HTTP route is left out:
it is the same code in every arm.

Every arm is a process of its own, with ``PYTHONPATH`` at its checkout, set up as harness.py
sets itself up (passive OpenMP waiting, glibc's mmap threshold pinned by
``agl.memory.release_freed_memory`` unless the arm sets ``MALLOC_MMAP_THRESHOLD_``), and the
arms alternate their order across ``--rounds``. Each reports wall time, decoded tokens/s, CPU
seconds (user and system), peak RSS and RSS after loading the model, and a hash of every
request's tokens, so the arms' outputs can be compared request by request.

Writes bench/results/engine_ab.md and .json.

    PYTHONPATH=. .venv/bin/python bench/engine_ab.py --baseline 6d4bb33          # ~10 min
    PYTHONPATH=. .venv/bin/python bench/engine_ab.py --baseline 6d4bb33 --mmap-threshold 33554432
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(args: argparse.Namespace) -> dict:
    """One arm's run, in this process (the checkout is whatever ``PYTHONPATH`` points at)."""
    from agl.memory import release_freed_memory

    release_freed_memory()
    import asyncio
    import random
    import resource
    import time

    import psutil
    import torch

    from agl.policy.engine import Engine, SamplingParams
    from bench.common import gsm8k_prompts, load_model

    policy = load_model(args.model)  # on the compute thread, as the engine's steps
    policy.model.eval()
    lengths = random.Random(args.seed).choices(range(args.min_tokens, args.max_tokens + 1), k=args.requests)
    prompts = [
        policy.render_chat([{"role": "user", "content": row["prompt_text"]}])
        for row in gsm8k_prompts("test", args.requests)
    ]

    async def run() -> tuple[list[list[int]], float]:
        engine = Engine(policy)
        await engine.start()
        queue = list(range(args.requests))
        tokens: list[list[int]] = [[] for _ in prompts]

        async def client() -> None:
            while queue:
                i = queue.pop(0)
                (seq,) = engine.submit(
                    prompts[i], SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
                )
                tokens[i] = (await seq.wait()).token_ids

        try:
            (warm,) = engine.submit(prompts[0], SamplingParams(max_tokens=4, temperature=0.0))  # first-call costs out
            await warm.wait()
            start = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.clients)))
            return tokens, time.perf_counter() - start
        finally:
            await engine.stop()

    loaded = psutil.Process().memory_info().rss / 2**20
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    tokens, wall = asyncio.run(run())
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    decoded = sum(len(t) for t in tokens)
    assert decoded == sum(lengths), "every request decodes exactly its max_tokens"
    return {
        "wall_s": wall,
        "tokens": decoded,
        "tokens_per_s": decoded / wall,
        "user_s": cpu.ru_utime - cpu_before.ru_utime,
        "system_s": cpu.ru_stime - cpu_before.ru_stime,
        "rss_after_load_mib": loaded,
        "peak_rss_mib": cpu.ru_maxrss / 1024,
        "torch": torch.__version__,
        "hashes": [hashlib.sha256(json.dumps(t).encode()).hexdigest()[:16] for t in tokens],
    }


def run_arm(arm: dict, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": arm["tree"], **arm["env"]}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", *args.passthrough]
    out = subprocess.run(command, env=env, cwd=arm["tree"], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"arm {arm['name']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(args: argparse.Namespace) -> None:
    import torch

    from bench.common import RESULTS, matmul_probe

    with tempfile.TemporaryDirectory() as scratch:
        baseline = Path(scratch) / "baseline"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), args.baseline],
            check=True,
            capture_output=True,
        )
        rev = subprocess.run(
            ["git", "-C", str(baseline), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip()
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip()
        arms = [
            {"name": f"baseline {rev}", "tree": str(baseline), "env": {}},
            {"name": f"this tree ({head}+)", "tree": str(ROOT), "env": {}},
        ]
        if args.mmap_threshold:
            arms.append(
                {
                    "name": f"this tree, mmap threshold {args.mmap_threshold}",
                    "tree": str(ROOT),
                    "env": {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)},
                }
            )
        probes = [matmul_probe(torch.bfloat16)]
        runs: dict[str, list[dict]] = {arm["name"]: [] for arm in arms}
        try:
            for round_ in range(args.rounds):
                for arm in arms if round_ % 2 == 0 else arms[::-1]:
                    result = run_arm(arm, args)
                    runs[arm["name"]].append(result)
                    print(
                        f"round {round_ + 1}, {arm['name']}: {result['tokens_per_s']:.1f} tok/s, "
                        f"peak {result['peak_rss_mib']:.0f} MiB, sys {result['system_s']:.0f} s",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
        probes.append(matmul_probe(torch.bfloat16))

    first = runs[arms[0]["name"]][0]["hashes"]
    summary = []
    for name, arm_runs in runs.items():
        median = {
            key: statistics.median(r[key] for r in arm_runs)
            for key in ("wall_s", "tokens_per_s", "user_s", "system_s", "peak_rss_mib", "rss_after_load_mib")
        }
        same = statistics.mean(sum(a == b for a, b in zip(r["hashes"], first)) / len(first) for r in arm_runs)
        summary.append(
            {
                "arm": name,
                **median,
                "same_tokens_as_baseline": same,
                "runs": [{k: v for k, v in r.items() if k != "hashes"} for r in arm_runs],
            }
        )
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(),
        "bf16_gflop_s_before_after": probes,
        "workload": {
            k: getattr(args, k) for k in ("model", "requests", "clients", "min_tokens", "max_tokens", "seed", "rounds")
        },
        "arms": summary,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine_ab.json").write_text(json.dumps(result, indent=2) + "\n")
    base = summary[0]
    lines = [
        "# The engine on an eval-like workload, arms side by side",
        "",
        f"{result['date']}; {args.requests} GSM8K test prompts, {args.clients} clients, greedy, max_tokens uniform in "
        f"[{args.min_tokens}, {args.max_tokens}] (seed {args.seed}), ignore_eos; "
        f"{args.rounds} alternated rounds, medians. "
        f"bf16 2048² matmul before/after: {probes[0]:.0f} / {probes[1]:.0f} GFLOP/s.",
        "",
        "| arm | tokens/s | × baseline | wall s | user CPU s | system CPU s | peak RSS MiB | RSS after load MiB "
        "| same tokens as baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['arm']} | {s['tokens_per_s']:.1f} | {s['tokens_per_s'] / base['tokens_per_s']:.2f} | "
            f"{s['wall_s']:.0f} | {s['user_s']:.0f} | "
            f"{s['system_s']:.0f} | {s['peak_rss_mib']:.0f} | {s['rss_after_load_mib']:.0f} | "
            f"{s['same_tokens_as_baseline']:.0%} |"
        )
    lines += ["", f"`PYTHONPATH=. .venv/bin/python bench/engine_ab.py {' '.join(sys.argv[1:])}`", ""]
    (RESULTS / "engine_ab.md").write_text("\n".join(lines))
    print("\n".join(lines))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", default="HEAD", help="git revision of the baseline arm")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="also run this tree with MALLOC_MMAP_THRESHOLD_ at this many bytes",
    )
    parser.add_argument("--rounds", type=int, default=2)
    workload = parser.add_argument_group("workload (passed to every arm)")
    workload.add_argument("--model", default="smollm2")
    workload.add_argument("--requests", type=int, default=128)
    workload.add_argument("--clients", type=int, default=32)
    workload.add_argument("--min-tokens", type=int, default=32)
    workload.add_argument("--max-tokens", type=int, default=256)
    workload.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.passthrough = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("model", "requests", "clients", "min_tokens", "max_tokens", "seed")
    ]
    return args


if __name__ == "__main__":
    args = parse()
    if args.worker:
        print(json.dumps(worker(args)))
    else:
        main(args)
