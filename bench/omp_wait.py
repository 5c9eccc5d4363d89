"""How OpenMP's idle threads should wait between operators: passive, or spinning for a while.

harness.py sets ``OMP_WAIT_POLICY=PASSIVE``: torch and bitsandbytes each load their own
libgomp, and with libgomp's default wait (spin ~300k iterations, then sleep) their idle threads
fought over the two cores. Passive threads sleep at once, so every parallel operator pays a
futex wake-up; a decode step runs ~150 of them (four matmuls and an attention per layer) between
small single-threaded ones. ``GOMP_SPINCOUNT`` bounds the spin instead (both copies of libgomp
read it).

Each setting runs in its own process (the runtime reads the environment once), alternated over
rounds; medians. Per setting:
  - ``decode``: one fast decode step (agl/policy/decode.py), batch 32, 300 cached positions, in ms;
  - ``update``: one GRPO micro-batch through the NF4 + LoRA model (bitsandbytes' dequantize and
    torch's matmuls, forward + backward), 8 x 128 tokens on a 150-token prompt, in s;
  - ``route``: 32 ``AsyncOpenAI`` clients through the HTTP route, 64 GSM8K requests x 64 greedy
    tokens, in tokens/s: the event loop, the clients and the engine thread share the cores.

    # ~4 min a round on the AMX machine; writes bench/results/omp_wait.{md,json}
    PYTHONPATH=. .venv/bin/python bench/omp_wait.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

from bench.common import RESULTS, ROOT

SETTINGS = {  # name -> environment
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 10k": {"GOMP_SPINCOUNT": "10000"},
    "spin 30k": {"GOMP_SPINCOUNT": "30000"},
}
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def child() -> None:
    """Measure the three workloads under this process's OpenMP environment; print JSON."""
    import asyncio
    import time

    import torch

    from agl.policy.decode import LlamaDecodeStep
    from agl.policy.engine import Engine
    from agl.policy.sampler_weights import MergedSampler
    from agl.route.server import ModelServer
    from bench.common import decode_inputs, drop_appended, load_model, timed
    from bench.profile_step import update_step
    from bench.serve import gsm8k_messages, route_run

    policy = load_model("smollm2")
    rows, cached = 32, 300
    step = LlamaDecodeStep(MergedSampler(policy.model, policy.compute_dtype))
    args = decode_inputs(policy.model.config, rows, cached)

    def decode() -> None:
        step(*args)
        drop_appended(args[3], cached)

    with torch.inference_mode():
        for _ in range(3):
            decode()
        decode_ms = 1e3 * statistics.median(timed(decode) for _ in range(15))
    update_step(policy, fused=True)  # warm-up
    update_s = statistics.median(update_step(policy, fused=True)["step_s"] for _ in range(2))

    async def route() -> float:
        engine = Engine(policy)
        await engine.start()
        server = ModelServer(engine, policy)
        await server.start()
        try:
            work = gsm8k_messages(64)
            await route_run(server.base_url, policy.name, work[:32], 32, 8)  # warm-up
            return (await route_run(server.base_url, policy.name, work, 32, 64))["tokens_per_s"]
        finally:
            await server.stop()
            await engine.stop()

    start = time.perf_counter()
    route_tok_s = asyncio.run(route())
    print(
        json.dumps(
            {
                "decode_ms": decode_ms,
                "update_s": update_s,
                "route_tok_s": route_tok_s,
                "wall_s": time.perf_counter() - start,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()

    import torch

    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for round_ in range(args.rounds):
        order = list(SETTINGS) if round_ % 2 == 0 else list(SETTINGS)[::-1]
        for name in order:
            env = (
                {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
                | SETTINGS[name]
                | {"PYTHONPATH": str(ROOT)}
            )
            out = subprocess.run(
                [sys.executable, __file__, "--child"], env=env, cwd=ROOT, capture_output=True, text=True, check=True
            )
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(round_ + 1, name, runs[name][-1], flush=True)
    keys = ("decode_ms", "update_s", "route_tok_s")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "rounds": args.rounds,
        "settings": SETTINGS,
        "medians": medians,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "omp_wait.json").write_text(json.dumps(result, indent=1) + "\n")
    base = medians["passive"]
    lines = [
        "# OpenMP wait policy: decode step, update micro-batch and the route, one process per setting",
        "",
        f"{result['date']}, {result['cpu']}, medians of {args.rounds} alternated rounds. "
        "Written by `bench/omp_wait.py`.",
        "",
        "| setting | decode step ms (batch 32) | update micro-batch s | route tok/s (32 clients) "
        "| decode / update / route vs passive |",
        "|---|---:|---:|---:|---|",
    ]
    for name, m in medians.items():
        ratios = (
            f"{base['decode_ms'] / m['decode_ms']:.2f}× / {base['update_s'] / m['update_s']:.2f}× / "
            f"{m['route_tok_s'] / base['route_tok_s']:.2f}×"
        )
        lines.append(f"| {name} | {m['decode_ms']:.1f} | {m['update_s']:.2f} | {m['route_tok_s']:.1f} | {ratios} |")
    (RESULTS / "omp_wait.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
