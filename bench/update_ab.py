"""One GRPO update step, before and after issue 51's update work, side by side in one process.

Workloads (the embedded SmolLM2-135M, NF4 + a LoRA r16 whose B is not zero, compute dtype ``auto``: bf16 on a CPU
with AVX512-BF16 or AMX; ``loss_type`` dapo, lr 0 so every round trains the same LoRA; completion ids random: the
cost does not depend on them):

  - ``sums``: the demo's GRPO step (conf/task/sums.yaml's recipe): 8 groups x 8 replies of 2-4 tokens on
    36-44-token prompts, no activation checkpointing;
  - ``gsm8k``: the default job's shape: 4 groups x 8 completions of 24-256 tokens (gamma, mean ~130) on 150-250-token
    prompts, activation checkpointing on.

Arms (each a ``GRPOUpdate.step`` on the same samples, alternated within each round):

  - ``before``: bitsandbytes dequantizes every 4-bit weight in each forward, replay and backward
    (``Policy.dequantize_once`` off: as of 0c76e0b);
  - ``cache``: each weight dequantized once a step (``dequantize_once``, agl/train/merged_lora.py's
    ``dequantized_4bit_layers``: the default on a CPU).

Per step: wall seconds, passes, tokens run (padding included) and trained, ms a trained token, and the matmul
limit: the FLOPs of the layers' and the head's matmuls for the tokens run (forward, checkpointing's replay,
backward's input gradients; the LoRA's and attention's are small beside them) over this run's bf16 matmul probe.
Reported: medians over rounds of per-round ratios to ``before``. ``--profile ARM`` prints torch.profiler's top
operators for one step of that arm.

    # writes bench/results/update_ab.{md,json}
    PYTHONPATH=. .venv/bin/python bench/update_ab.py [--rounds 3] [--workloads sums gsm8k] [--profile cache]
"""

from __future__ import annotations

import os

from agl.memory import release_freed_memory  # noqa: E402

release_freed_memory()  # as harness.py: before torch allocates

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402

from bench.common import RESULTS, cpu, load_model, matmul_probe, memory_probe  # noqa: E402

WORKLOADS = {  # groups, rows a group, prompt tokens (low, high), completion tokens (low, high, mean), checkpointing
    "sums": (8, 8, (36, 44), (2, 4, None), False),
    "gsm8k": (4, 8, (150, 250), (24, 256, 130), True),
}


def samples_of(workload: str, seed: int = 0) -> tuple[list, list[float], bool]:
    """(samples, advantages, activation checkpointing) of ``workload``."""
    from agl.train.samples import Sample

    groups, rows, (p_low, p_high), (c_low, c_high, c_mean), checkpointing = WORKLOADS[workload]
    rng = random.Random(seed)
    samples, advantages = [], []
    for g in range(groups):
        prompt = [rng.randint(100, 40000) for _ in range(rng.randint(p_low, p_high))]
        for r in range(rows):
            if c_mean is None:
                length = rng.randint(c_low, c_high)
            else:  # gamma(shape 3) around the mean, cut to the range
                length = min(c_high, max(c_low, round(rng.gammavariate(3.0, c_mean / 3))))
            samples.append(
                Sample(
                    rollout_id=f"{g}-{r}",
                    prompt_ids=prompt,
                    completion_ids=[rng.randint(100, 40000) for _ in range(length)],
                    mask=[1] * length,
                    logprobs=[-1.0] * length,
                    reward=float(r % 2),
                    truncated=False,
                    group=str(g),
                )
            )
            advantages.append(1.0 if r % 2 else -1.0)
    return samples, advantages, checkpointing


ARMS = {"before": False, "cache": True}  # arm -> Policy.dequantize_once


def layer_parameters(policy) -> tuple[int, int]:
    """(the decoder layers' linear parameters, the vocabulary head's)."""
    from agl.train.merged_lora import dequantizable_4bit_layers

    layers = sum(m.in_features * m.out_features for m in dequantizable_4bit_layers(policy.model))
    head = policy.model.get_base_model().get_output_embeddings().weight
    return layers, head.numel()


def step(policy, update_cls, config, arm: str, samples, advantages, profile: bool = False) -> dict:
    policy = dataclasses.replace(policy, dequantize_once=ARMS[arm])
    update = update_cls(policy, config)
    tokens: list[int] = []
    import agl.train.micro_batches as micro_batches

    plan_now = micro_batches.plan_micro_batches(samples, config.micro_batch_size, config.micro_batch_tokens)
    batches = micro_batches.StepBatches(
        samples,
        advantages,
        policy,
        weighting="token-mean",
        size=config.micro_batch_size,
        tokens=config.micro_batch_tokens,
        mask_truncated=False,
    )
    for mb in batches:
        batch = mb.batch
        if batch.shared_prompt is not None:
            rows, width = batch.completion_BT.shape
            tokens.append(rows * width + (len(batch.shared_prompt) if not mb.shared or mb.opens else 0))
        else:
            tokens.append(batch.input_ids_BL.numel())
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            update.step(samples, advantages)
        print(f"--- {arm}: torch.profiler, one step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    start = time.perf_counter()
    metrics = update.step(samples, advantages)
    seconds = time.perf_counter() - start
    prompt_passes = sum(
        1 for mb in batches if mb.batch.shared_prompt is not None and (not mb.shared or mb.opens)
    )  # a shared prompt is a pass of its own
    return {
        "step_s": seconds,
        "micro_batches": len(plan_now),
        "passes": len(plan_now) + prompt_passes,
        "tokens_run": sum(tokens),
        "trained_tokens": metrics["train_tokens"],
        "loss": metrics["loss"],
        "forward_s": metrics.get("forward_s", 0.0),
        "backward_s": metrics.get("backward_s", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--profile", choices=list(ARMS), default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    from agl.config import GRPOConfig
    from agl.train.grpo import GRPOUpdate

    probes = {"bf16_gflops": [], "fp32_gflops": [], "memory_gbs": []}

    def probe() -> None:
        probes["bf16_gflops"].append(round(matmul_probe(torch.bfloat16), 1))
        probes["fp32_gflops"].append(round(matmul_probe(torch.float32), 1))
        probes["memory_gbs"].append(round(memory_probe(), 2))

    probe()
    policy = load_model()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a LoRA as after some training: a fresh B makes its product vanish
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.002)
    layer_params, head_params = layer_parameters(policy)
    rows: dict[str, dict[str, list[dict]]] = {w: defaultdict(list) for w in args.workloads}
    for workload in args.workloads:
        samples, advantages, checkpointing = samples_of(workload)
        config = GRPOConfig(lr=0.0, loss={"type": "dapo", "epsilon_high": None}, gradient_checkpointing=checkpointing)
        step(policy, GRPOUpdate, config, "cache", samples, advantages)  # warm-up
        if args.profile:
            step(policy, GRPOUpdate, config, args.profile, samples, advantages, profile=True)
        for r in range(args.rounds):
            order = args.arms if r % 2 == 0 else args.arms[::-1]
            for arm in order:
                result = step(policy, GRPOUpdate, config, arm, samples, advantages)
                passes = 3 if checkpointing else 2  # forward, (replay), backward's input gradients
                flops = 2 * passes * (result["tokens_run"] * layer_params + result["trained_tokens"] * head_params)
                result["matmul_limit_s"] = flops / (probes["bf16_gflops"][-1] * 1e9)
                rows[workload][arm].append(result)
                print(workload, r, arm, {k: round(v, 3) for k, v in result.items()}, flush=True)
            probe()
    result = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": cpu(),
        "torch_threads": torch.get_num_threads(),
        "probes": probes,
        "layer_parameters": layer_params,
        "head_parameters": head_params,
        "rows": {w: dict(arms) for w, arms in rows.items()},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "update_ab.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "update_ab.md"), "w") as f:
        f.write(render(result))
    print(render(result))


def render(result: dict) -> str:
    p = result["probes"]
    lines = [
        f"# One GRPO update step, before and after ({result['date']})",
        "",
        f"`PYTHONPATH=. .venv/bin/python bench/update_ab.py` on {result['machine']}, {result['torch_threads']} "
        f"threads; probes over the run: bf16 {min(p['bf16_gflops'])}-{max(p['bf16_gflops'])} GFLOP/s, fp32 "
        f"{min(p['fp32_gflops'])}-{max(p['fp32_gflops'])}, memory {min(p['memory_gbs'])}-{max(p['memory_gbs'])} GB/s.",
        "",
        "| workload | arm | passes | tokens run | trained | step s | ms / trained token | matmul limit s | share "
        "| × before (each round) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for workload, arms in result["rows"].items():
        before = arms.get("before")
        for arm, runs in arms.items():
            step_s = statistics.median(r["step_s"] for r in runs)
            limit = statistics.median(r["matmul_limit_s"] for r in runs)
            trained = runs[0]["trained_tokens"]
            ratios = [b["step_s"] / r["step_s"] for b, r in zip(before, runs)] if before else []
            ratio = f"**{statistics.median(ratios):.2f}** ({', '.join(f'{x:.2f}' for x in ratios)})" if ratios else ""
            lines.append(
                f"| {workload} | {arm} | {runs[0]['passes']} | {runs[0]['tokens_run']} | {trained:.0f} | {step_s:.2f} "
                f"| {1000 * step_s / trained:.1f} | {limit:.2f} | {limit / step_s:.2f} | {ratio} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
