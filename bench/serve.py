"""Throughput of the model route next to this CPU's limits, with the decode step's variants side by side.

Route: ``clients`` concurrent ``AsyncOpenAI`` clients send GSM8K chat requests through the
HTTP server (engine + route in this process), 256 new tokens each, forced with the
``ignore_eos`` extension and greedy decoding. The engine's decode step alternates between
``engine.decode`` variants (``model``: the model's forward; ``fast``: agl/policy/decode.py) within each
round, same engine, same merged weights, so the machine's other load hits both alike. ``dense`` is ``fast``
with ``engine.decode_4bit_rows=0``: every step on the dense merged weights, none on the NF4 base.

Limits: a memory probe (GB/s reading a 1 GiB float32 tensor) and a matmul probe (GFLOP/s of a
2048 x 2048 matmul in the sampler's dtype), best of 5, before and after the runs (the higher kept).
Every decode step the engine ran is logged (rows, cache width), and for each level:
  - bandwidth limit: tokens / sum over steps of (sampler weight bytes as stored + KV cache bytes
    at that step's rows x width) / GB/s: reading everything a step needs once from memory;
  - compute limit: tokens / sum over steps of rows x (2 x matmul parameters + 4 x layers x heads x
    head dim x width) / GFLOP/s.
Prefill is left out of both (a prompt is prefilled once per 256 decoded tokens).

``--direct`` also runs ``model.generate`` (through the LoRA model) on the same prompts in
left-padded batches of ``clients``, as the earlier table did.

Writes bench/results/serve.md and bench/results/serve.json.

    PYTHONPATH=. /work/main/.venv/bin/python bench/serve.py            # ~30 min on the shared 2-core CPU
    PYTHONPATH=. /work/main/.venv/bin/python bench/serve.py --clients 1 8 --new-tokens 16 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import openai
import torch

from agl.memory import peak_rss_mib
from agl.policy import compute_thread
from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.route.server import ModelServer
from bench.common import RESULTS, gsm8k_prompts, matmul_probe, memory_probe, model_config, record_decode_steps


def gsm8k_messages(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": row["prompt_text"]}] for row in gsm8k_prompts("test", count)]


async def route_run(base_url: str, model: str, work: list[list[dict]], clients: int, new_tokens: int) -> dict:
    """Each client sends its share of ``work`` one request after another; all clients at once."""
    shares = [work[i::clients] for i in range(clients)]
    sdk = [openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600) for _ in range(clients)]

    async def client_loop(client: openai.AsyncOpenAI, share: list[list[dict]]) -> int:
        tokens = 0
        for messages in share:
            r = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=new_tokens, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.usage.completion_tokens == new_tokens, r.usage
            tokens += r.usage.completion_tokens
        return tokens

    try:
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client_loop(c, s) for c, s in zip(sdk, shares))))
        wall = time.perf_counter() - start
    finally:
        await asyncio.gather(*(c.close() for c in sdk))
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


@torch.inference_mode()
def direct_run(policy, work: list[list[dict]], batch_size: int, new_tokens: int) -> dict:
    """``generate`` over the same prompts, ``batch_size`` at a time, left-padded."""
    pad = policy.tokenizer.pad_token_id if policy.tokenizer.pad_token_id is not None else policy.eos_token_ids[0]
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(work), batch_size):
        prompts = [policy.render_chat(m) for m in work[i : i + batch_size]]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=policy.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=policy.device)
        out = policy.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        tokens += (out.shape[1] - width) * len(prompts)
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def step_costs(engine: Engine) -> dict:
    """What one decode step must read and compute, as functions of its rows and cache width."""
    from agl.policy.sampler_weights import DenseLinear

    model = engine.merged.model()
    config = model.config
    dense = [m for m in model.modules() if isinstance(m, DenseLinear)]
    head = model.get_output_embeddings()
    weight_bytes = (
        sum(m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0) for m in dense) + head.weight.nbytes
    )
    weight_bytes += sum(p.nbytes for name, p in model.named_parameters() if "norm" in name)
    matmul_params = sum(m.weight.numel() for m in dense) + head.weight.numel()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    kv_dtype_bytes = model.get_input_embeddings().weight.element_size()  # keys/values come off the residual stream
    return {
        "weight_bytes": weight_bytes,
        "matmul_params": matmul_params,
        "kv_bytes_per_token": layers * 2 * config.num_key_value_heads * head_dim * kv_dtype_bytes,
        "attention_flops_per_cached_token": 4 * layers * heads * head_dim,
        "sampler_dtype": str(dense[0].weight.dtype).removeprefix("torch."),
    }


def limits(steps: list[tuple[int, int]], costs: dict, gb_s: float, gflop_s: float) -> dict:
    """tok/s if every decode step in ``steps`` (rows, width) ran at the memory or the compute limit."""
    tokens = sum(rows for rows, _ in steps)
    read = sum(costs["weight_bytes"] + rows * width * costs["kv_bytes_per_token"] for rows, width in steps)
    flops = sum(
        rows * (2 * costs["matmul_params"] + width * costs["attention_flops_per_cached_token"]) for rows, width in steps
    )
    return {
        "decode_steps": len(steps),
        "mean_rows": tokens / len(steps),
        "mean_width": sum(w for _, w in steps) / len(steps),
        "bandwidth_tokens_per_s": tokens / (read / (gb_s * 1e9)),
        "compute_tokens_per_s": tokens / (flops / (gflop_s * 1e9)),
    }


async def main(args: argparse.Namespace) -> dict:
    cfg = model_config(args.model)
    # every torch call on the engine's thread, as in a job (agl/policy/compute_thread.py: one OpenMP pool)
    policy = await compute_thread.run(load_policy, cfg, "cpu")
    policy.model.eval()
    engine = Engine(policy, max_batch_size=max(64, max(args.clients)))
    fast_step = engine.decode_step
    assert fast_step is not None or args.decode == ["model"], "agl.policy.decode does not apply to this model"
    quantized_rows = fast_step.quantized_rows if fast_step is not None else 0

    def use(variant: str) -> None:
        engine.decode_step = None if variant == "model" else fast_step
        if fast_step is not None:
            fast_step.quantized_rows = 0 if variant == "dense" else quantized_rows

    steps = record_decode_steps(engine)
    await engine.start()
    server = ModelServer(engine, policy)
    await server.start()
    dtype = policy.compute_dtype
    probes = {
        "gb_s": [await compute_thread.run(memory_probe)],
        "gflop_s": [await compute_thread.run(matmul_probe, dtype)],
    }
    works = {c: gsm8k_messages(max(c, args.min_requests)) for c in args.clients}
    runs: dict[int, dict[str, list]] = {
        c: {v: [] for v in [*args.decode, *(["direct"] if args.direct else [])]} for c in args.clients
    }
    try:
        for variant in args.decode:  # warm-up: first-call costs out of the timings
            use(variant)
            await route_run(server.base_url, policy.name, gsm8k_messages(2), 2, 4)
        if args.direct:
            await compute_thread.run(direct_run, policy, gsm8k_messages(2), 2, 4)
        for round_ in range(args.repeats):
            for c in args.clients:
                order = args.decode if round_ % 2 == 0 else args.decode[::-1]
                for variant in order:  # the variants back to back on the same work (the engine idles between)
                    use(variant)
                    steps.clear()
                    run = await route_run(server.base_url, policy.name, works[c], c, args.new_tokens)
                    run["steps"] = list(steps)
                    runs[c][variant].append(run)
                    print(f"round {round_ + 1}, {c} clients, {variant}: {run['tokens_per_s']:.1f} tok/s", flush=True)
                if args.direct:
                    runs[c]["direct"].append(await compute_thread.run(direct_run, policy, works[c], c, args.new_tokens))
        probes["gb_s"].append(await compute_thread.run(memory_probe))
        probes["gflop_s"].append(await compute_thread.run(matmul_probe, dtype))
    finally:
        await server.stop()
        await engine.stop()
    costs = step_costs(engine)
    gb_s, gflop_s = max(probes["gb_s"]), max(probes["gflop_s"])
    levels = []
    for c in args.clients:
        level = {"clients": c, "requests": len(works[c])}
        for variant, variant_runs in runs[c].items():
            level[variant] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in variant_runs),
                "runs": [{k: v for k, v in r.items() if k != "steps"} for r in variant_runs],
            }
        other = "model" if "model" in runs[c] else "dense"
        if "fast" in runs[c] and other in runs[c]:
            ratios = [f["tokens_per_s"] / m["tokens_per_s"] for f, m in zip(runs[c]["fast"], runs[c][other])]
            level["fast_over_model"] = statistics.median(ratios)
            level["fast_over"] = other
            level["ratios"] = ratios
        level["limits"] = limits(runs[c][args.decode[0]][0]["steps"], costs, gb_s, gflop_s)
        levels.append(level)
    return {
        "model": policy.name,
        "quantization": cfg.quantization,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "new_tokens": args.new_tokens,
        "decode_variants": args.decode,
        "levels": levels,
        "repeats": args.repeats,
        "probes": probes,
        "memory_gb_s": gb_s,
        "matmul_gflop_s": gflop_s,
        "step_costs": costs,
        "peak_rss_mb": peak_rss_mib(),
        "torch_threads": torch.get_num_threads(),
        "machine": (
            f"{platform.machine()}, {torch.backends.cpu.get_cpu_capability()}, "
            f"{torch.get_num_threads()} torch threads, CPU"
        ),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (libgomp's bounded spin)"),
        "load_average": os.getloadavg(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def markdown(result: dict) -> str:
    costs = result["step_costs"]
    variants = result["decode_variants"]
    lines = [
        "# Model route throughput and this CPU's limits",
        "",
        f"{result['model']} ({result['quantization']} base, sampled from merged {costs['sampler_dtype']} weights), "
        f"compute dtype {result['compute_dtype']}, {result['machine']}, OMP_WAIT_POLICY={result['omp_wait_policy']}, "
        f"{result['date']}. Each request: a GSM8K test question through the chat template, {result['new_tokens']} new "
        "tokens (greedy, `ignore_eos`), concurrent `AsyncOpenAI` clients over HTTP. Written by `bench/serve.py`.",
        "",
        f"Probes (best of 5, before and after): memory {result['memory_gb_s']:.1f} GB/s "
        f"({', '.join(f'{x:.1f}' for x in result['probes']['gb_s'])}), {result['compute_dtype']} matmul "
        f"{result['matmul_gflop_s']:.1f} GFLOP/s ({', '.join(f'{x:.1f}' for x in result['probes']['gflop_s'])}). "
        f"A decode step reads {costs['weight_bytes'] / 1e6:.0f} MB of weights "
        f"plus {costs['kv_bytes_per_token'] / 1e3:.1f} kB "
        "of KV cache per row and cached position, "
        f"and computes {2 * costs['matmul_params'] / 1e9:.3f} GFLOP per row in "
        "matmuls plus attention.",
        "",
        "| clients | "
        + " | ".join(f"{v} tok/s" for v in variants)
        + (
            f" | fast / {result['levels'][0]['fast_over']} | each round"
            if "fast_over_model" in result["levels"][0]
            else ""
        )
        + " | steps x rows, width | bandwidth limit tok/s | compute limit tok/s | "
        + f"{variants[-1]} / lower limit |",
        "|---:|"
        + "---:|" * len(variants)
        + ("---:|---|" if "fast_over_model" in result["levels"][0] else "")
        + "---|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        lim = lv["limits"]
        row = [str(lv["clients"]), *(f"{lv[v]['tokens_per_s']:.1f}" for v in variants)]
        if "fast_over_model" in lv:
            row += [f"**{lv['fast_over_model']:.2f}**", ", ".join(f"{r:.2f}" for r in lv["ratios"])]
        lower = min(lim["bandwidth_tokens_per_s"], lim["compute_tokens_per_s"])
        row += [
            f"{lim['decode_steps']} x {lim['mean_rows']:.1f}, {lim['mean_width']:.0f}",
            f"{lim['bandwidth_tokens_per_s']:.0f}",
            f"{lim['compute_tokens_per_s']:.0f}",
            f"{lv[variants[-1]]['tokens_per_s'] / lower:.2f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    if "direct" in result["levels"][0]:
        lines += [
            "",
            "`model.generate` in batches of `clients`: "
            + ", ".join(f"{lv['clients']}: {lv['direct']['tokens_per_s']:.1f} tok/s" for lv in result["levels"]),
        ]
    lines += [
        "",
        f"Medians of {result['repeats']} rounds; in each round the variants run back to back on the same requests, "
        "in alternating order, and the ratio is the median of the per-round ratios (the machine is shared; load "
        f"average at the end {', '.join(f'{x:.1f}' for x in result['load_average'])}). Steps, rows and width (cache "
        "positions incl. left padding) are the decode steps the engine ran in the first run of the level; the limits "
        f"count them alone (no prefill). Peak RSS {result['peak_rss_mb']:.0f} MiB.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a conf/model/*.yaml")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--min-requests", type=int, default=1, help="requests per level at least (1 client sends them in turn)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="rounds; medians are reported")
    parser.add_argument(
        "--decode",
        nargs="+",
        default=["model", "fast"],
        choices=["model", "dense", "fast"],
        help="engine.decode variants (dense: fast with engine.decode_4bit_rows=0)",
    )
    parser.add_argument("--direct", action="store_true", help="also time model.generate on the same prompts")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "serve.md").write_text(markdown(result))
    print(markdown(result))
