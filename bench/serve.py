"""Throughput of the model route against direct batched HF ``generate`` of the same work.

Route: ``clients`` concurrent ``AsyncOpenAI`` clients send GSM8K chat requests through the
HTTP server (engine + route in this process), 128 new tokens each, forced with the
``ignore_eos`` extension and greedy decoding. Direct: ``policy.model.generate`` on the same
prompts rendered by the same chat template, left-padded, in batches of ``clients``, with
``min_new_tokens = max_new_tokens = 128``. Both use the same NF4 + LoRA policy on CPU, one after
the other, so they never compete for the cores.

Writes bench/results/serve.md and bench/results/serve.json.

    cd /work/main && PYTHONPATH=. .venv/bin/python bench/serve.py            # embedded SmolLM2-135M
    PYTHONPATH=. .venv/bin/python bench/serve.py --clients 1 8 --new-tokens 16   # a quick look
"""
from __future__ import annotations

import os

# torch and bitsandbytes each bring their own OpenMP runtime; with the default (active,
# spinning) wait policy their idle threads fight for the two cores and a forward pass on the
# main thread gets ~10x slower. Passive waiting must be set before either runtime starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import openai
import torch

from agl.engine import Engine
from agl.jobs import peak_rss_mib
from agl.model import load_policy
from agl.server import ModelServer
from bench.common import RESULTS, gsm8k_prompts, model_config


def gsm8k_messages(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": row["prompt_text"]}] for row in gsm8k_prompts("test", count)]


async def route_run(server: ModelServer, work: list[list[dict]], clients: int, new_tokens: int) -> dict:
    """Each client sends its share of ``work`` one request after another; all clients at once."""
    shares = [work[i::clients] for i in range(clients)]
    sdk = [openai.AsyncOpenAI(base_url=server.base_url, api_key="bench", max_retries=0, timeout=3600) for _ in range(clients)]

    async def client_loop(client: openai.AsyncOpenAI, share: list[list[dict]]) -> int:
        tokens = 0
        for messages in share:
            r = await client.chat.completions.create(
                model=server.policy.name, messages=messages, max_tokens=new_tokens, temperature=0, extra_body={"ignore_eos": True}
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
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad
        )
        tokens += (out.shape[1] - width) * len(prompts)
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


async def main(args: argparse.Namespace) -> dict:
    cfg = model_config(args.model)
    policy = load_policy(cfg, "cpu")
    policy.model.eval()
    engine = Engine(policy, max_batch_size=max(64, max(args.clients)))
    await engine.start()
    server = ModelServer(engine, policy)
    await server.start()
    works = {c: gsm8k_messages(max(c, args.min_requests)) for c in args.clients}
    runs: dict[int, list[tuple[dict, dict]]] = {c: [] for c in args.clients}
    try:
        await route_run(server, gsm8k_messages(2), 2, 4)  # warm-up: first-call costs out of the timings
        direct_run(policy, gsm8k_messages(2), 2, 4)
        for _ in range(args.repeats):
            for c in args.clients:  # each route run is followed at once by its direct twin (the engine idles)
                route = await route_run(server, works[c], c, args.new_tokens)
                runs[c].append((route, direct_run(policy, works[c], c, args.new_tokens)))
    finally:
        await server.stop()
        await engine.stop()
    levels = []
    for c in args.clients:
        pairs = runs[c]
        levels.append(
            {
                "clients": c,
                "requests": len(works[c]),
                "route_tokens_per_s": statistics.median(r["tokens_per_s"] for r, _ in pairs),
                "direct_tokens_per_s": statistics.median(d["tokens_per_s"] for _, d in pairs),
                "ratio": statistics.median(r["tokens_per_s"] / d["tokens_per_s"] for r, d in pairs),
                "ratios": [r["tokens_per_s"] / d["tokens_per_s"] for r, d in pairs],
                "runs": [{"route": r, "direct": d} for r, d in pairs],
            }
        )
    return {
        "model": policy.name,
        "quantization": cfg.quantization,
        "new_tokens": args.new_tokens,
        "levels": levels,
        "repeats": args.repeats,
        "peak_rss_mb": peak_rss_mib(),
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, CPU",
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def markdown(result: dict) -> str:
    lines = [
        "# Model route throughput",
        "",
        f"{result['model']} ({result['quantization']} + LoRA), {result['machine']}, "
        f"OMP_WAIT_POLICY={result['omp_wait_policy']}, {result['date']}.",
        f"Each request: a GSM8K test question through the chat template, {result['new_tokens']} new tokens "
        "(greedy, `ignore_eos`). Route = concurrent `AsyncOpenAI` clients over HTTP; direct = "
        "`model.generate` on the same prompts in left-padded batches of the same size. Written by `bench/serve.py`.",
        "",
        "| clients | requests | route tok/s | direct tok/s | route / direct | ratio of each run pair |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for lv in result["levels"]:
        lines.append(
            f"| {lv['clients']} | {lv['requests']} | {lv['route_tokens_per_s']:.1f} | {lv['direct_tokens_per_s']:.1f} | "
            f"{lv['ratio']:.2f} | {', '.join(f'{r:.2f}' for r in lv['ratios'])} |"
        )
    lines += [
        "",
        f"Medians of {result['repeats']} rounds; in each round every route run is followed at once by its direct "
        "twin, and the ratio is the median over these pairs (the machine is shared, so other load comes and goes). "
        f"Peak RSS of the process (policy, engine, route, clients and the direct runs): {result['peak_rss_mb']:.0f} MiB.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a conf/model/*.yaml without Hydra defaults")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--min-requests", type=int, default=4, help="requests per level at least (1 client sends them in turn)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "serve.md").write_text(markdown(result))
    print(markdown(result))
