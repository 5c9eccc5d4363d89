"""Where an eval's resident memory goes over time: the default job's eval through the real route.

    PYTHONPATH=. .venv/bin/python bench/eval_memory.py [--problems 160] [--interval 5]

Runs what the GRPO job's greedy evals run (``agl.eval.evaluate.evaluate_rows``: a Runtime with its
store, engine, HTTP route and 32 runners; the GSM8K agent with its own ``openai.OpenAI``
client per rollout) on the first ``--problems`` test problems, set up as harness.py is. A task
on the event loop samples, every ``--interval`` s:

  - resident size, and the part of it that is file-backed (``RssFile``: mapped files' pages, the
    model's safetensors file among them);
  - the engine's KV-cache buffers (bytes of every layer's key and value buffers: capacity, not
    the live part) and the rows decoding;
  - glibc's heap: bytes its arenas hold (``mallinfo2().arena``) and use (``uordblks``: tensors
    under the 1 MiB mmap threshold, Python objects over 512 bytes, native libraries' allocations),
    and bytes in mmapped blocks (``hblkhd``: tensors of 1 MiB and more, the KV buffers among them);
  - full (generation 2) garbage collections so far.

At the end it collects garbage and trims the heaps, then reports the heap still in use per
rollout: memory that stays with the process as an eval goes on, the part of the default job's
peak that grows with its ~3,000 rollouts rather than with any one phase. ``--arena-max N`` caps
glibc's malloc arenas (each thread that allocates gets one, up to 8 per core);
``--collect-every N`` sets ``runner.collect_every`` (0: only Python's own full collections).
Writes bench/results/eval_memory.{md,json} (eval_memory_arena_max_N.* or
eval_memory_collect_every_N.* with those options). ~4 min for 160
problems on the AMX machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as harness.py, before torch loads

import argparse
import asyncio
import datetime
import gc
import json
import shutil
import tempfile
import time

from agl.config import to_typed
from agl.memory import (
    _libc_function,
    mallinfo,
    release_freed_memory,
)  # the cached libc lookup agl's mallopt and malloc_trim use
from bench.common import RESULTS, ROOT

M_ARENA_MAX = -8  # mallopt parameter, from glibc's malloc.h


def heap() -> dict[str, int]:
    """glibc's heap in MiB: held by its arenas, in use there, and in mmapped blocks of their own."""
    info = mallinfo()
    return {"arenas_mib": info.arena >> 20, "heap_in_use_mib": info.uordblks >> 20, "mmapped_mib": info.hblkhd >> 20}


def file_backed_mib() -> int:
    """``RssFile`` of /proc/self/status: resident pages of mapped files, in MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) >> 10 for line in status if line.startswith("RssFile:"))


def kv_buffer_bytes(engine) -> int:
    """Bytes of the engine's KV buffers (agl.policy.kv_cache.SlotLayer), every running batch and layer.
    Reads the engine's private batch list: the engine has no reason to publish it."""
    return sum(
        tensor.numel() * tensor.element_size()
        for batch in engine._batches
        for layer in batch.cache.layers
        if getattr(layer, "buffers", None) is not None
        for tensor in layer.buffers
    )


async def measure(problems: int, interval: float, overrides: list[str]) -> dict:
    import psutil

    from agl.config import compose_checked
    from agl.eval.evaluate import evaluate_rows
    from agl.memory import collect, peak_rss_mib
    from agl.runtime import Runtime

    cfg = compose_checked(str(ROOT / "conf"), ["task=gsm8k", "algo=eval", "progress=false", *overrides])
    process = psutil.Process()
    full_collections = 0

    def count_full_collections(phase: str, info: dict) -> None:
        nonlocal full_collections
        full_collections += phase == "stop" and info["generation"] == 2

    gc.callbacks.append(count_full_collections)
    run_dir = tempfile.mkdtemp(prefix="agl-eval-memory-")
    samples: list[dict] = []
    try:
        async with Runtime.of(to_typed(cfg), run_dir) as rt:
            rows = rt.task.load(cfg.task.eval_split)[:problems]
            started = time.perf_counter()

            def sample() -> dict:
                return {
                    "s": round(time.perf_counter() - started, 1),
                    "rss_mib": process.memory_info().rss >> 20,
                    "file_backed_mib": file_backed_mib(),
                    "kv_buffers_mib": kv_buffer_bytes(rt.engine) >> 20,
                    "rows": rt.engine.num_running,
                    **heap(),
                    "full_gcs": full_collections,
                }

            async def monitor() -> None:
                while True:
                    samples.append(sample())
                    await asyncio.sleep(interval)

            watcher = asyncio.create_task(monitor())
            scores = await evaluate_rows(
                rt,
                rows,
                resources=rt.task.resources_for(cfg.task.prompt),
                sampling={"temperature": 0.0, "max_tokens": cfg.task.max_tokens},
                tag={"eval_step": 0},
            )
            watcher.cancel()
            at_end = sample()
            samples.append(at_end)
            collect()  # a full garbage collection, then malloc_trim
            collected = sample()
            completion_tokens = sum(s.get("completion_tokens", 0) for s in scores)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    first = samples[0]
    return {
        "problems": problems,
        "seconds": collected["s"],
        "completion_tokens": completion_tokens,
        "peak_rss_mib": round(peak_rss_mib()),
        "at_start": first,
        "at_end": at_end,
        "after_gc_and_trim": collected,
        "heap_growth_per_rollout_mib": (collected["heap_in_use_mib"] - first["heap_in_use_mib"]) / problems,
        "max_kv_buffers_mib": max(s["kv_buffers_mib"] for s in samples),
        "samples": samples,
    }


def markdown(result: dict, command: str) -> str:
    lines = [
        "# An eval's resident memory over time",
        "",
        f"{result['date']}. `{command}`. "
        "The GRPO job's greedy eval (store, engine, HTTP route, 32 runners, the GSM8K agent) "
        f"on the first {result['problems']} test problems, set up as harness.py is; {result['seconds']:.0f} s, "
        f"{result['completion_tokens']} completion tokens. Process peak RSS {result['peak_rss_mib']} MiB; "
        "the KV buffers peaked at "
        f"{result['max_kv_buffers_mib']} MiB. "
        f"Heap in use grew by **{result['heap_growth_per_rollout_mib']:.2f} MiB per rollout** "
        "(start of the eval to its end, after a full garbage collection and malloc_trim).",
        "",
        "| when | s | RSS MiB | of it file-backed MiB | KV buffers MiB | rows | glibc arenas MiB | in use there MiB "
        "| glibc mmapped MiB | full GCs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    step = max(1, len(result["samples"]) // 12)
    picked = [("during", s) for s in result["samples"][::step]]
    picked += [("end", result["at_end"]), ("after gc + trim", result["after_gc_and_trim"])]
    lines += [
        f"| {when} | {s['s']:.0f} | {s['rss_mib']} | {s['file_backed_mib']} | {s['kv_buffers_mib']} | {s['rows']} | "
        f"{s['arenas_mib']} | {s['heap_in_use_mib']} | "
        f"{s['mmapped_mib']} | {s['full_gcs']} |"
        for when, s in picked
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", type=int, default=160)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument(
        "--collect-every",
        type=int,
        default=None,
        help="runner.collect_every (finished rollouts between full GCs + malloc_trim); default: the config's",
    )
    parser.add_argument(
        "--arena-max",
        type=int,
        default=0,
        help="glibc's M_ARENA_MAX (malloc arenas for all threads); 0: glibc's default, 8 per core",
    )
    args = parser.parse_args()
    release_freed_memory()  # as harness.py, before torch allocates
    if args.arena_max:
        assert _libc_function("mallopt")(M_ARENA_MAX, args.arena_max) == 1
    overrides = [] if args.collect_every is None else [f"runner.collect_every={args.collect_every}"]
    result = asyncio.run(measure(args.problems, args.interval, overrides))
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    command = (
        f"PYTHONPATH=. .venv/bin/python bench/eval_memory.py --problems {args.problems}"
        + (f" --arena-max {args.arena_max}" if args.arena_max else "")
        + (f" --interval {args.interval:g}" if args.interval != 5.0 else "")
        + (f" --collect-every {args.collect_every}" if args.collect_every is not None else "")
    )
    result["arena_max"], result["collect_every"] = args.arena_max, args.collect_every
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = (
        "eval_memory"
        + (f"_arena_max_{args.arena_max}" if args.arena_max else "")
        + (f"_collect_every_{args.collect_every}" if args.collect_every is not None else "")
    )
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result, command)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
