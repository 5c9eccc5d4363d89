"""Does splitting a decode batch across the cores beat one batch on all of them? (It did not here.)

One decode step of the embedded model (agl/policy/decode.py's fast step, float32 merged weights, every
row with ``--cached`` cached positions) timed three ways, alternated, medians of ``--rounds``:

  - ``one batch``: all rows, torch on its usual 2 threads (MKL splits each product);
  - ``two halves``: two half batches, each with its own KV cache, stepped at once by a pool of two
    workers that run torch single-threaded (one core each);
  - ``one thread``: all rows on one thread (the halves' cost if they did not overlap).

Writes bench/results/decode_shards.{md,json}.

    PYTHONPATH=. .venv/bin/python bench/decode_shards.py        # ~1 min
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see harness.py

import argparse
import datetime
import json
import statistics
from concurrent.futures import ThreadPoolExecutor

import torch

from agl.policy.decode import LlamaDecodeStep
from agl.policy.sampler_weights import MergedSampler
from bench.common import RESULTS, decode_inputs, drop_appended, load_model, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--cached", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    policy = load_model("smollm2")
    policy.model.eval()
    step = LlamaDecodeStep(MergedSampler(policy.model, policy.compute_dtype))
    config, threads = policy.model.config, torch.get_num_threads()
    pool = ThreadPoolExecutor(2, initializer=torch.set_num_threads, initargs=(1,))

    def run(b: tuple) -> None:
        step(*b)
        drop_appended(b[3], args.cached)

    def single_threaded(fn) -> None:
        torch.set_num_threads(1)  # MKL's thread count is process-wide
        try:
            fn()
        finally:
            torch.set_num_threads(threads)

    levels = []
    with torch.inference_mode():
        for rows in args.rows:
            whole, halves = (
                decode_inputs(config, rows, args.cached),
                [decode_inputs(config, rows // 2, args.cached) for _ in range(2)],
            )
            variants = {
                "one batch": lambda: run(whole),
                "two halves": lambda: single_threaded(lambda: list(pool.map(run, halves))),
                "one thread": lambda: single_threaded(lambda: run(whole)),
            }
            for fn in variants.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {name: [] for name in variants}
            for round_ in range(args.rounds):
                for name in list(variants) if round_ % 2 == 0 else list(variants)[::-1]:
                    times[name].append(timed(variants[name]))
            levels.append(
                {
                    "rows": rows,
                    "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
                    "all_ms": {n: [1e3 * x for x in t] for n, t in times.items()},
                }
            )
            print(rows, {name: round(ms) for name, ms in levels[-1]["ms"].items()}, flush=True)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cached": args.cached,
        "threads": threads,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "levels": levels,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode_shards.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# A decode step: one batch on every thread vs. half batches one thread each",
        "",
        f"{result['date']}, {result['cpu']}, {threads} torch threads, {args.cached} cached positions per row, "
        "medians of "
        f"{args.rounds} alternated rounds. Written by `bench/decode_shards.py`.",
        "",
        "| rows | one batch ms | two halves at once ms | one thread ms | halves / one batch |",
        "|---:|---:|---:|---:|---:|",
    ]
    for lv in levels:
        ms = lv["ms"]
        lines.append(
            f"| {lv['rows']} | {ms['one batch']:.0f} | {ms['two halves']:.0f} | {ms['one thread']:.0f} | "
            f"{ms['two halves'] / ms['one batch']:.2f} |"
        )
    (RESULTS / "decode_shards.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
