"""What bitwise-repeatable sampling costs: the engine batched vs. batch-invariant, side by side.

    PYTHONPATH=. .venv/bin/python bench/batch_invariance.py [--dtype bfloat16] [--seqs 32] [--tokens 64]

Each round samples the same seeded requests (GSM8K prompts, ``--seqs`` sequences of
``--tokens`` new tokens, all submitted at once) through both engines, alternating, and
checks what each mode promises: the batch-invariant engine gives every sequence the same
tokens and log-probs as sampling it alone; the batched one need not. Writes
``bench/results/batch_invariance.{md,json}``; the ratio is the figure to quote (absolute
times move with this shared machine's speed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from agl.policy.engine import Engine, SamplingParams
from bench.common import RESULTS, gsm8k_prompts, load_model


async def sample(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[float, list]:
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    start = time.perf_counter()
    streams = [engine.submit(p, sp)[0] for p, sp in zip(prompts, params)]
    done = [await s.wait() for s in streams]
    return time.perf_counter() - start, [(s.token_ids, s.logprobs) for s in done]


async def main(args: argparse.Namespace) -> dict:
    policy = load_model(compute_dtype=args.dtype)
    rows = gsm8k_prompts("test", args.seqs)
    prompts = [policy.render_chat([{"role": "user", "content": r["prompt_text"]}]) for r in rows]
    engines = {
        mode: Engine(policy, max_batch_size=64, batch_invariant=(mode == "invariant"))
        for mode in ("batched", "invariant")
    }
    for engine in engines.values():
        await engine.start()
    await sample(engines["batched"], prompts[:2], 4)  # warm-up (merges the sampler weights)
    seconds: dict[str, list[float]] = {mode: [] for mode in engines}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            elapsed, outputs[mode] = await sample(engine, prompts, args.tokens)
            seconds[mode].append(elapsed)
    # Sampled alone, sequence 0 is the reference both modes are compared with.
    _, [alone] = await sample(engines["invariant"], prompts[:1], args.tokens)
    for engine in engines.values():
        await engine.stop()
    new_tokens = args.seqs * args.tokens
    result = {
        "dtype": str(policy.compute_dtype).removeprefix("torch."),
        "seqs": args.seqs,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "seconds": seconds,
        "tokens_per_s": {mode: new_tokens / statistics.median(s) for mode, s in seconds.items()},
        "same_as_alone": {mode: outputs[mode][0] == alone for mode in engines},
    }
    result["slowdown"] = result["tokens_per_s"]["batched"] / result["tokens_per_s"]["invariant"]
    return result


def markdown(r: dict) -> str:
    lines = [
        "# Batched vs. batch-invariant sampling",
        "",
        "`PYTHONPATH=. .venv/bin/python bench/batch_invariance.py "
        f"--dtype {r['dtype']} --seqs {r['seqs']} --tokens {r['tokens']}`: "
        f"SmolLM2-135M-Instruct NF4, {r['dtype']} compute, "
        f"{r['seqs']} seeded sequences x {r['tokens']} new tokens submitted together, "
        f"medians of {r['rounds']} alternated rounds.",
        "",
        "| engine | tokens/s | sequence 0 identical to sampling it alone |",
        "|---|---:|---|",
    ]
    for mode in ("batched", "invariant"):
        lines.append(f"| {mode} | {r['tokens_per_s'][mode]:.0f} | {r['same_as_alone'][mode]} |")
    lines += ["", f"Batch invariance costs {r['slowdown']:.1f}x in decoding throughput at this batch size.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / "batch_invariance"
    (stem.with_suffix(".json")).write_text(json.dumps(result, indent=2) + "\n")
    (stem.with_suffix(".md")).write_text(markdown(result))
    print(markdown(result))
