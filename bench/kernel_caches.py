"""What torch's CPU kernel caches hold over a job, at the libraries' capacity (1,024) and at agl's.

Where torch runs a matmul through oneDNN (bf16 on AVX-512/AMX CPUs), each new shape compiles a
kernel that two LRU caches keep: oneDNN's primitive cache and ideep's around it
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``; agl.memory.cap_kernel_caches). A
job never runs out of new shapes: every SFT micro-batch, GRPO micro-batch and prefill has its own
length. This bench runs a job's mix in one fresh process per capacity, capacities alternating:

  1. decode: ``--prompts`` GSM8K test prompts x 256 greedy tokens, 32 at a time, through ``Engine``;
  2. ``--steps`` SFT warm-up steps (agl.train.sft's loss and backward, AdamW, inside ``update_memory``),
     each on a fresh seeded batch of 8 demonstrations: the shapes churn;
  3. the same decode again: are the decode step's kernels still cached (tokens/s)?

Per stage: malloc's bytes in use after it (``mallinfo2().uordblks``, after a GC and a trim: what
the process holds, not what its heaps happen to keep free), its wall time; and the process's
peak RSS. The decoded tokens and the SFT losses must be the same at both capacities.

    PYTHONPATH=. .venv/bin/python bench/kernel_caches.py [--steps 24 --prompts 32 --rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

from bench.common import RESULTS, ROOT

CAPACITIES = {"libraries' default": 1024, "agl": 64}


def child(capacity: int, prompts: int, steps: int) -> dict:
    """One capacity's stages, in this (fresh) process."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as harness.py
    from agl import memory

    memory.release_freed_memory()
    memory.cap_kernel_caches(capacity)
    import random

    import torch
    from omegaconf import OmegaConf

    from agl.config import SFTConfig
    from agl.policy.engine import Engine, SamplingParams
    from agl.train.sft import render_demonstration, sft_loss_and_backward
    from bench.common import gsm8k_prompts, load_model
    from tasks.gsm8k.agent import demonstrations

    def in_use_mib() -> float:
        memory.collect()
        return memory.mallinfo().uordblks / 2**20

    stages: list[dict] = []

    def stage(name: str, run) -> object:
        began = time.perf_counter()
        out = run()
        stages.append({"stage": name, "seconds": time.perf_counter() - began, "in_use_mib": in_use_mib()})
        print(json.dumps(stages[-1]), file=sys.stderr, flush=True)
        return out

    policy = stage("load policy", load_model)
    engine = Engine(policy, max_batch_size=32)
    ids = [policy.render_chat([{"role": "user", "content": r["prompt_text"]}]) for r in gsm8k_prompts("test", prompts)]
    loop = asyncio.new_event_loop()  # one loop for the engine's whole life

    async def decode() -> list[list[int]]:
        await engine.start()
        params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
        streams = [stream for p in ids for stream in engine.submit(p, params)]  # the engine batches 32 at a time
        return [list(s.token_ids) for s in await asyncio.gather(*(stream.wait() for stream in streams))]

    def decode_stage(name: str) -> str:
        """Run the decode as stage ``name``; a digest of the tokens it made."""
        tokens = stage(name, lambda: loop.run_until_complete(decode()))
        stages[-1]["tokens_per_s"] = sum(map(len, tokens)) / stages[-1]["seconds"]
        return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]

    first = decode_stage("decode")
    sft = SFTConfig()
    template = OmegaConf.load(ROOT / "conf" / "task" / "gsm8k.yaml").prompts.cot
    demos = demonstrations("train", prompt_template=template)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=sft.lr, weight_decay=sft.weight_decay)
    rng = random.Random(0)
    losses: list[float] = []

    def sft_steps() -> None:
        for _ in range(steps):
            examples = [
                render_demonstration(policy, demos[i], sft.max_length)
                for i in rng.sample(range(len(demos)), sft.batch_size)
            ]
            with memory.update_memory():  # as agl/train/sft.py's update
                policy.model.train()
                optimizer.zero_grad(set_to_none=True)
                stats = sft_loss_and_backward(
                    policy, examples, sft.micro_batch_size, sft.micro_batch_tokens, sft.gradient_checkpointing
                )
                losses.append(stats["loss"])
                torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), sft.max_grad_norm)
                optimizer.step()
                policy.model.eval()
            policy.version += 1

    stage(f"{steps} SFT steps", sft_steps)
    stages[-1]["seconds_per_step"] = stages[-1]["seconds"] / steps
    second = decode_stage("decode again")
    loop.run_until_complete(engine.stop())
    loop.close()
    import resource

    return {
        "capacity": capacity,
        "stages": stages,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "decode_tokens": first,
        "decode_again_tokens": second,
        "sft_losses": losses,
    }


def _median_stage(rounds: list[dict]) -> dict:
    return {
        "stage": rounds[0]["stage"],
        **{key: statistics.median(r[key] for r in rounds) for key in rounds[0] if key != "stage"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", type=int, metavar="CAPACITY")
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.prompts, args.steps)))
        return
    from agl.memory import KERNEL_CACHES

    env = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHES}
    runs: dict[str, list[dict]] = {name: [] for name in CAPACITIES}
    for _ in range(args.rounds):
        for name, capacity in CAPACITIES.items():
            command = [
                sys.executable,
                __file__,
                "--child",
                str(capacity),
                "--prompts",
                str(args.prompts),
                "--steps",
                str(args.steps),
            ]
            out = subprocess.run(
                command, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True, check=True
            )
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, json.dumps({s["stage"]: round(s["in_use_mib"]) for s in runs[name][-1]["stages"]}), flush=True)
    every = [r for rs in runs.values() for r in rs]
    same = {
        key: len({json.dumps(r[key]) for r in every}) == 1
        for key in ("decode_tokens", "decode_again_tokens", "sft_losses")
    }
    median = {
        name: {
            "stages": [_median_stage([r["stages"][i] for r in rs]) for i in range(len(rs[0]["stages"]))],
            "ru_maxrss_mib": statistics.median(r["ru_maxrss_mib"] for r in rs),
        }
        for name, rs in runs.items()
    }
    import torch

    from bench.common import matmul_probe

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "prompts": args.prompts,
        "steps": args.steps,
        "rounds": args.rounds,
        "capacities": CAPACITIES,
        "same": same,
        "bf16_gflops_after": matmul_probe(torch.bfloat16),
        "median": median,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kernel_caches.json").write_text(json.dumps(result, indent=2) + "\n")
    names = list(CAPACITIES)
    lines = [
        "# Kernel caches: heap in use over a job's shapes, at the libraries' capacity and at agl's",
        "",
        f"{result['date']}. `PYTHONPATH=. .venv/bin/python bench/kernel_caches.py "
        f"--steps {args.steps} --prompts {args.prompts} --rounds {args.rounds}`. "
        "SmolLM2-135M-Instruct (nf4 + LoRA r16), this CPU's compute dtype, mmap threshold pinned as harness.py does; "
        "one fresh process per "
        f"capacity, capacities alternating, medians of {args.rounds} round(s). "
        "Heap in use: mallinfo2's uordblks after a GC and a trim. "
        f"bf16 matmul probe after the runs: {result['bf16_gflops_after']:.0f} GFLOP/s.",
        "",
        "| stage | "
        + " | ".join(f"{n} ({CAPACITIES[n]}): heap in use MiB | s | tokens/s" for n in names)
        + " | time ratio |",
        "|---|" + "---|---|---|" * len(names) + "---|",
    ]
    for i, ref in enumerate(median[names[0]]["stages"]):
        cells = []
        for n in names:
            s = median[n]["stages"][i]
            cells += [
                f"{s['in_use_mib']:,.0f}",
                f"{s['seconds']:.1f}",
                f"{s['tokens_per_s']:.0f}" if "tokens_per_s" in s else "",
            ]
        lines.append(
            f"| {ref['stage']} | "
            + " | ".join(cells)
            + f" | {median[names[1]]['stages'][i]['seconds'] / ref['seconds']:.2f}x |"
        )
    lines += [
        "",
        "Peak RSS: " + ", ".join(f"{n} {median[n]['ru_maxrss_mib']:,.0f} MiB" for n in names) + ". "
        "Same decoded tokens and SFT losses at both capacities: "
        + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items())
        + ".",
    ]
    (RESULTS / "kernel_caches.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
