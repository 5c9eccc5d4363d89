"""Where resident memory goes when freed tensors stay in malloc's heaps, and what pinning
glibc's mmap threshold (agl/memory.py, set by harness.py) changes, side by side.

    PYTHONPATH=. .venv/bin/python bench/memory.py [--prompts 128] [--rounds 2]

Workload: the embedded policy's engine decodes ``--prompts`` GSM8K test prompts, 256 greedy
tokens each, 64 at a time (the eval of a GRPO job, without HTTP). Each variant runs in a fresh
process (a process's peak RSS cannot be reset); variants alternate within each round. Reported
per variant: RSS after loading the model, peak RSS, RSS at the end, and tokens/s (the ratio is
the figure to quote: this shared machine's speed moves). Writes bench/results/memory.{md,json}.

Left out for now: a per-phase breakdown of a whole GRPO step (update activations, optimizer,
SFT); the update's peak is measured by the default job's /usr/bin/time in README.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys

from bench.common import RESULTS, ROOT

VARIANTS = {"default malloc": {"AGL_BENCH_PIN": "0"}, "mmap threshold pinned at 1 MiB": {"AGL_BENCH_PIN": "1"}}


def child(prompts: int) -> dict:
    """One variant's measurement, in this (fresh) process."""
    import resource

    if os.environ.get("AGL_BENCH_PIN") == "1":
        from agl.memory import release_freed_memory

        assert release_freed_memory()
    import time

    import psutil

    from agl.engine import Engine, SamplingParams
    from bench.common import gsm8k_prompts, load_model

    policy = load_model()
    loaded = psutil.Process().memory_info().rss
    ids = [policy.render_chat([{"role": "user", "content": r["prompt_text"]}]) for r in gsm8k_prompts("test", prompts)]

    async def run() -> tuple[int, float]:
        engine = Engine(policy, max_batch_size=64)
        await engine.start()
        gate = asyncio.Semaphore(64)

        async def one(p: list[int]) -> int:
            async with gate:
                seq = engine.submit(p, SamplingParams(max_tokens=256, temperature=0.0))[0]
                return len((await seq.wait()).token_ids)

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in ids)))
        elapsed = time.perf_counter() - start
        await engine.stop()
        return tokens, elapsed

    tokens, elapsed = asyncio.run(run())
    mib = 2**20
    return {"loaded_mib": loaded / mib, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "end_mib": psutil.Process().memory_info().rss / mib, "tokens": tokens, "tokens_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.prompts)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, env in VARIANTS.items():
            out = subprocess.run([sys.executable, __file__, "--child", "--prompts", str(args.prompts)], cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    base, pinned = (median[name] for name in VARIANTS)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "prompts": args.prompts, "rounds": args.rounds,
              "runs": runs, "median": median, "speed_ratio_pinned_over_default": pinned["tokens_per_s"] / base["tokens_per_s"]}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Resident memory of the engine's decode: default malloc vs. the pinned mmap threshold", "",
        f"{result['date']}. SmolLM2-135M-Instruct (nf4 + LoRA, merged sampler), CPU. {args.prompts} GSM8K test prompts x 256 greedy "
        f"tokens, 64 at a time, through `Engine` (no HTTP). Medians of {args.rounds} rounds, variants alternating, each in a fresh process. "
        "Written by `bench/memory.py`.", "",
        "| malloc | RSS after load (MiB) | peak RSS (MiB) | RSS at the end (MiB) | tokens/s |", "|---|---:|---:|---:|---:|",
        *(f"| {name} | {m['loaded_mib']:.0f} | {m['peak_mib']:.0f} | {m['end_mib']:.0f} | {m['tokens_per_s']:.1f} |" for name, m in median.items()),
        "", f"tokens/s, pinned / default: {result['speed_ratio_pinned_over_default']:.2f} (per round: "
        + ", ".join(f"{p['tokens_per_s'] / d['tokens_per_s']:.2f}" for d, p in zip(*runs.values())) + ")", "",
    ]
    (RESULTS / "memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
