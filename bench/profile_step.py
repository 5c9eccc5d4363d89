"""Where a GRPO step's time goes, part by part, with the alternatives side by side in one process.

Three measurements on the embedded model (NF4 + fresh LoRA r16, compute dtype ``auto``):

  - decode: one batch-32 decode step (150-token prompts, KV cache appended in place), through
    the LoRA model vs. the merged dense sampling weights (``engine.weights`` adapter | merged);
  - engine: 4 GSM8K prompts x 8 samples x 128 tokens through ``Engine``, split into model
    forward and token sampling;
  - update: one GRPO micro-batch (8 x 128 completion tokens sharing a 150-token prompt),
    forward + backward: the fused log-prob head with the LoRA layers merged (agl/train/merged_lora.py)
    and through peft's own LoRA forward, and the model's own logits.

Variants alternate within each measurement (medians), so machine noise hits both alike.
``--profile`` also prints torch.profiler's top operators for a decode step and an update.

    PYTHONPATH=. .venv/bin/python bench/profile_step.py        # ~3 min; writes bench/results/profile_step.{md,json}
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import time
from collections import defaultdict

import torch

from agl.policy.compute_thread import call
from bench.common import RESULTS, gsm8k_prompts, load_model, matmul_probe, time_method

BATCH, PROMPT, NEW_TOKENS = 32, 150, 128


def decode_steps(model, steps: int, profile: bool = False) -> float:
    """Median ms of one batch-32 decode step after a 150-token prefill."""
    from agl.policy.kv_cache import slot_cache

    gen = torch.Generator().manual_seed(0)
    cache = slot_cache()
    mask = torch.ones(BATCH, PROMPT, dtype=torch.long)

    def decode_one() -> float:
        nonlocal mask
        mask = torch.cat([mask, torch.ones(BATCH, 1, dtype=torch.long)], dim=1)
        start = time.perf_counter()
        model(
            input_ids=torch.randint(100, 40000, (BATCH, 1), generator=gen),
            attention_mask=mask,
            position_ids=torch.full((BATCH, 1), mask.shape[1] - 1),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        model(
            input_ids=torch.randint(100, 40000, (BATCH, PROMPT), generator=gen),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        times = [decode_one() for _ in range(steps + 2)]
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                decode_one()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 1000 * statistics.median(times[2:])


def engine_split(policy, weights: str) -> dict:
    """4 GSM8K prompts x 8 samples x 128 tokens through the engine: forward vs sampling seconds."""
    from agl.policy.engine import Engine, SamplingParams

    prompts = [
        policy.render_chat([{"role": "user", "content": row["prompt_text"]}]) for row in gsm8k_prompts("train", 4)
    ]
    timings: dict[str, float] = defaultdict(float)

    async def run() -> None:
        engine = Engine(policy, weights=weights)
        time_method(engine, "_forward", "forward_s", timings)
        time_method(engine, "_sample", "sample_s", timings)
        await engine.start()
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True)
        start = time.perf_counter()
        seqs = [s for p in prompts for s in engine.submit(p, params, n=8)]
        await asyncio.gather(*(s.wait() for s in seqs))
        timings["total_s"] = time.perf_counter() - start
        await engine.stop()

    asyncio.run(run())
    return dict(timings)


def update_step(policy, fused: bool, merged: bool | None = None, profile: bool = False) -> dict:
    """One GRPO micro-batch of 8 x 128 tokens sharing a 150-token prompt: forward/backward seconds.
    ``merged``: LoRA layers merged in the update or not (None: the policy's ``train_merged``)."""
    import dataclasses

    import agl.train.forward as forward
    import agl.train.grpo as grpo
    from agl.train.samples import Sample

    if merged is not None:
        policy = dataclasses.replace(policy, train_merged=merged)

    rng = random.Random(0)
    samples = [
        Sample(
            rollout_id=str(i),
            prompt_ids=list(range(1000, 1000 + PROMPT)),
            completion_ids=[rng.randint(100, 40000) for _ in range(NEW_TOKENS)],
            mask=[1] * NEW_TOKENS,
            logprobs=[-1.0] * NEW_TOKENS,
            reward=float(i % 2),
            truncated=False,
            group="g",
        )
        for i in range(8)
    ]
    update = grpo.GRPOUpdate(
        policy, grpo.GRPOConfig(lr=0.0, loss={"type": "dapo", "epsilon_high": None}, micro_batch_size=8)
    )
    advantages = [1.0 if i % 2 else -1.0 for i in range(8)]
    original = forward.fused_head  # completion_logprobs looks it up in its module
    forward.fused_head = original if fused else (lambda _policy: None)
    try:
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                update.step(samples, advantages)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        start = time.perf_counter()
        metrics = update.step(samples, advantages)
        return {
            "step_s": time.perf_counter() - start,
            "forward_s": metrics["forward_s"],
            "backward_s": metrics["backward_s"],
        }
    finally:
        forward.fused_head = original


def median_of(rows: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top operators")
    parser.add_argument(
        "--parts", nargs="+", choices=["decode", "engine", "update"], default=["decode", "engine", "update"]
    )
    args = parser.parse_args()

    from agl.policy.sampler_weights import MergedSampler

    policy = load_model()
    policy.model.eval()
    probes = [matmul_probe(policy.compute_dtype)]  # the machine's speed varies: its matmul peak before and after
    merged = MergedSampler(policy.model, policy.compute_dtype)
    models = {"adapter": lambda: policy.model, "merged": merged.model}
    decode = {name: [] for name in models} if "decode" in args.parts else {}
    engine = {name: [] for name in models} if "engine" in args.parts else {}
    update_variants = {  # (fused head, LoRA layers merged)
        "fused, LoRA merged": (True, True),
        "fused, peft LoRA": (True, False),
        "model logits": (False, policy.train_merged),
    }
    update = {name: [] for name in update_variants} if "update" in args.parts else {}
    if update:
        call(update_step, policy, fused=True)  # warm-up
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}", flush=True)
        for name in decode:
            decode[name].append(call(decode_steps, models[name](), steps=10))
        for name in engine:
            engine[name].append(engine_split(policy, name))
        turn = round_ % max(len(update), 1)
        for name in list(update)[turn:] + list(update)[:turn]:  # each variant first in turn
            fused, lora_merged = update_variants[name]
            update[name].append(call(update_step, policy, fused=fused, merged=lora_merged))
    if args.profile:
        call(decode_steps, merged.model(), steps=1, profile=True)
        call(update_step, policy, fused=True, profile=True)

    probes.append(matmul_probe(policy.compute_dtype))
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "compute_dtype": str(policy.compute_dtype).removeprefix("torch."),
        "matmul_probe_gflops": probes,
        "decode_step_ms": {k: statistics.median(v) for k, v in decode.items()},
        "engine": {k: median_of(v) for k, v in engine.items()},
        "update_micro_batch": {k: median_of(v) for k, v in update.items()},
        "update_rounds_s": {k: [r["step_s"] for r in v] for k, v in update.items()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "profile_step.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "profile_step.md").write_text(render(result))
    print(render(result))


def render(result: dict) -> str:
    d, e, u = result["decode_step_ms"], result["engine"], result["update_micro_batch"]
    rounds = result.get("update_rounds_s", {})
    paired = ""
    if "fused, LoRA merged" in rounds and len(rounds["fused, LoRA merged"]) > 1:
        ratios = sorted(m / p for m, p in zip(rounds["fused, LoRA merged"], rounds["fused, peft LoRA"]))
        paired = (
            "\nUpdate micro-batch, LoRA merged / peft LoRA, per round (paired): "
            f"median **{statistics.median(ratios):.3f}**, "
            f"{sum(r < 1 for r in ratios)} of {len(ratios)} rounds below 1; "
            f"sorted: {', '.join(f'{r:.3f}' for r in ratios)}.\n"
        )
    lines = [
        "# Step parts: alternatives side by side",
        "",
        f"{result['date']}. SmolLM2-135M-Instruct NF4 + LoRA r16, compute dtype auto ({result['compute_dtype']}), CPU; "
        f"{result['compute_dtype']} 2048² matmul probe "
        f"{result['matmul_probe_gflops'][0]:.0f} / {result['matmul_probe_gflops'][1]:.0f} GFLOP/s "
        "before / after. Medians of alternated rounds. Written by `bench/profile_step.py`.",
        "",
        "| part | variant | ms or s |",
        "|---|---|---:|",
        *(f"| decode step, batch {BATCH}, {PROMPT}-token prompts | {k} | {v:.1f} ms |" for k, v in d.items()),
        *(
            f"| engine, 4 prompts x 8 x {NEW_TOKENS} tokens | {k}: total / forward / sampling | "
            f"{v['total_s']:.2f} / {v['forward_s']:.2f} / {v['sample_s']:.2f} s |"
            for k, v in e.items()
        ),
        *(
            f"| update micro-batch, 8 x {NEW_TOKENS} + {PROMPT} prompt | {k}: total / forward / backward | "
            f"{v['step_s']:.2f} / {v['forward_s']:.2f} / {v['backward_s']:.2f} s |"
            for k, v in u.items()
        ),
    ]
    return "\n".join(lines) + "\n" + paired


if __name__ == "__main__":
    main()
