"""The GPU benchmarks of bench/gpu_check.sh, one part per call, each writing gpu_<part>.json (and .md) to --out.

  env    the GPU, versions, and its two ceilings: memory bandwidth (a large device-to-device copy, bytes read
         plus bytes written) and the bf16 matmul rate
  grpo   the GRPO step (B 4 x G 8, --new-tokens) of agl against TRL's GRPOTrainer with PEFT QLoRA, the same
         model on the same GPU (bench/grpo_vs_trl.py's workers: one warm-up step, then --steps timed), at each
         of --shapes (random weights in SmolLM2-135M's, Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes, the embedded
         tokenizer's vocabulary): step time, completion tokens/s, peak VRAM, against the issue's targets
  route  the route's decode tokens/s at --clients concurrent clients (greedy, --new-tokens each, ignore_eos),
         next to the bandwidth limit: every decode step reading the sampler's weights and its KV cache once
         (bench/serve.py's accounting) at the measured bandwidth
  summary  gpu_summary.md: the lane's result, the ceilings and every target, from the files above

``--cpu-dry-run`` runs each part at toy size on the CPU (model=tiny, a few tokens, two client counts) to
catch bugs before device time is spent. Budgets: each worker and each part has a timeout; what did not
finish is written as such, never left out silently.

    PYTHONPATH=. python3 bench/gpu_bench.py env --out /tmp/gpu
    PYTHONPATH=. python3 bench/gpu_bench.py grpo --out /tmp/gpu --tokenizer .gpu/tokenizer
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import time
from importlib import metadata
from pathlib import Path

SHAPES = ["shape_smollm2_135m", "shape_qwen25_05b", "shape_qwen25_15b"]
CLIENTS = [1, 8, 32, 64, 256]
TARGETS = {  # the issue's
    "steps_per_s_over_trl": 3.0,
    "peak_vram_1_5b_bytes": 5e9,  # "peak VRAM <= 5 GB" for the Qwen2.5-1.5B shape
    "bandwidth_fraction_64_clients": 0.25,
}


def versions() -> dict:
    out = {}
    for package in ("torch", "transformers", "peft", "bitsandbytes", "trl", "accelerate"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def device_name(device: str) -> str:
    import torch

    if device == "cpu":
        import platform

        return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return torch.cuda.get_device_name(device)


def copy_bandwidth(device: str, gib: float, rounds: int = 10) -> float:
    """GB/s of a device-to-device copy of ``gib`` GiB, bytes read plus bytes written, median of ``rounds``."""
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device).random_()  # never zeros
    dst = torch.empty_like(src)
    times = []
    if device == "cpu":
        for _ in range(rounds):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    else:
        for _ in range(3):
            dst.copy_(src)
        for _ in range(rounds):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times) / 1e9


def write(out: Path, name: str, data: dict, markdown: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_{name}.json").write_text(json.dumps(data, indent=1, default=str))
    if markdown is not None:
        (out / f"gpu_{name}.md").write_text(markdown)


def read(out: Path, name: str) -> dict | None:
    path = out / f"gpu_{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------- env


def part_env(args: argparse.Namespace) -> None:
    import torch

    from bench.common import matmul_probe

    gib = 0.0625 if args.cpu_dry_run else 2.0
    n = 512 if args.cpu_dry_run else 8192
    data = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device_name(args.device),
        "cuda": torch.version.cuda,
        "versions": versions(),
        "copy_gib": gib,
        "bandwidth_gb_s": copy_bandwidth(args.device, gib),
        "bf16_matmul_n": n,
        "bf16_tflop_s": matmul_probe(torch.bfloat16, n, warmup=3, device=args.device) / 1e3,
        "memory_gib": torch.cuda.get_device_properties(args.device).total_memory / 2**30
        if args.device != "cpu"
        else None,
        "cpu_dry_run": args.cpu_dry_run,
    }
    write(args.out, "env", data)
    print(json.dumps(data, indent=1))


# ----------------------------------------------------------------------------- grpo


def part_grpo(args: argparse.Namespace) -> None:
    from bench.grpo_vs_trl import Target, launch, resolved_dtype, summarize

    shapes = ["tiny"] if args.cpu_dry_run else args.shapes
    new_tokens = 8 if args.cpu_dry_run else args.new_tokens
    deadline = time.monotonic() + args.budget_s
    env = read(args.out, "env") or {}
    peak = {"bf16_gflops": env.get("bf16_tflop_s", 0) * 1e3 or 1.0, "fp32_gflops": 1.0, "bf16_native": True}
    results: dict[str, dict] = {}
    for shape in shapes:
        target = Target(shape, args.device, args.tokenizer)
        results[shape] = {}
        for system in ("agl", "trl"):
            left = deadline - time.monotonic()
            if left < 10:
                results[shape][system] = {"error": "not run: the part's time budget was spent"}
                continue
            started = time.monotonic()
            try:
                run = launch(system, args.steps, new_tokens, True, "glibc", target, timeout=left)
                summary = summarize([run], peak, resolved_dtype("auto", args.device))
                results[shape][system] = {**summary, "wall_s": time.monotonic() - started}
            except Exception as error:  # a timeout or a failed worker: recorded, the next one still runs
                results[shape][system] = {"error": f"{type(error).__name__}: {str(error)[-1500:]}"}
            print(f"{shape} {system}: {json.dumps(results[shape][system])[:300]}", flush=True)
    data = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device_name(args.device),
        "workload": {"B": 4, "G": 8, "new_tokens": new_tokens, "timed_steps": args.steps, "warmup_steps": 1},
        "versions": versions(),
        "targets": TARGETS,
        "compute_dtype": resolved_dtype("auto", args.device),
        "shapes": results,
        "cpu_dry_run": args.cpu_dry_run,
    }
    data["verdicts"] = grpo_verdicts(results)
    write(args.out, "grpo", data, grpo_markdown(data))
    print(grpo_markdown(data))


def grpo_verdicts(results: dict) -> dict:
    verdicts = {}
    for shape, systems in results.items():
        agl, trl = systems.get("agl", {}), systems.get("trl", {})
        if "step_s" not in agl or "step_s" not in trl:
            verdicts[shape] = {"complete": False}
            continue
        ratio = trl["step_s"] / agl["step_s"]
        verdict = {
            "complete": True,
            "steps_per_s_over_trl": ratio,
            "speed_target_met": ratio >= TARGETS["steps_per_s_over_trl"],
            "vram_not_above_trl": agl["peak_vram_mib"] <= trl["peak_vram_mib"],
        }
        if shape.endswith("15b"):
            verdict["vram_5gb_met"] = agl["peak_vram_mib"] * 2**20 <= TARGETS["peak_vram_1_5b_bytes"]
        verdicts[shape] = verdict
    return verdicts


def grpo_markdown(data: dict) -> str:
    work = data["workload"]
    lines = [
        f"# GRPO step on {data['device']}: agl vs TRL GRPOTrainer (PEFT QLoRA)",
        "",
        f"{data['date']}. B={work['B']} x G={work['G']}, <= {work['new_tokens']} new tokens, NF4 + LoRA r16, "
        f"{data.get('compute_dtype', '?')} compute, random weights in each shape with the embedded tokenizer "
        f"(49,152 tokens); one warm-up step then {work['timed_steps']} timed, per system, in its own process. "
        "Versions: "
        + ", ".join(f"{k} {v}" for k, v in data["versions"].items())
        + ". Written by bench/gpu_bench.py (bench/gpu_check.sh).",
        "",
        "| shape | system | s / step | completion tok/s | peak VRAM MiB | logprob_diff_abs | steps/s vs TRL |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape, systems in data["shapes"].items():
        verdict = data["verdicts"].get(shape, {})
        for system, r in systems.items():
            if "error" in r:
                lines.append(f"| {shape} | {system} | not finished: {r['error'][:120]} | | | | |")
                continue
            ratio = f"{verdict['steps_per_s_over_trl']:.2f}x" if system == "agl" and verdict.get("complete") else ""
            diff = f"{r['logprob_diff_abs']:.4f}" if system == "agl" else ""
            lines.append(
                f"| {shape} | {system} | {r['step_s']:.2f} | {r['completion_tok_s']:.0f} | "
                f"{r['peak_vram_mib']:.0f} | {diff} | {ratio} |"
            )
    lines += [
        "",
        "Targets (issue 38): agl >= 3x TRL's steps/s at every shape, at no more peak VRAM than TRL; the "
        "Qwen2.5-1.5B shape's peak VRAM <= 5 GB.",
        "",
    ]
    for shape, verdict in data["verdicts"].items():
        lines.append(f"- {shape}: " + ", ".join(f"{k} = {v}" for k, v in verdict.items()))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- route


async def route_levels(args: argparse.Namespace) -> dict:
    import torch

    from agl.policy.engine import Engine
    from agl.route.server import ModelServer
    from bench.common import load_model, record_decode_steps
    from bench.serve import gsm8k_messages, limits, route_run, step_costs

    model = "tiny" if args.cpu_dry_run else args.route_shape
    clients = [1, 4] if args.cpu_dry_run else args.clients
    new_tokens = 8 if args.cpu_dry_run else args.route_tokens
    policy = load_model(model, None, args.device, args.tokenizer)
    policy.model.eval()
    engine = Engine(policy, max_batch_size=max(clients), decode=args.route_decode)
    steps = record_decode_steps(engine)
    await engine.start()
    server = ModelServer(engine, policy)
    await server.start()
    levels = []
    deadline = time.monotonic() + args.budget_s
    try:
        await route_run(server.base_url, policy.name, gsm8k_messages(2), 2, 4)  # warm-up
        for c in clients:
            if time.monotonic() > deadline:
                levels.append({"clients": c, "error": "not run: the part's time budget was spent"})
                continue
            steps.clear()
            run = await route_run(server.base_url, policy.name, gsm8k_messages(c), c, new_tokens)
            levels.append({"clients": c, **run, "steps": list(steps)})
            print(f"{c} clients: {run['tokens_per_s']:.0f} tok/s", flush=True)
    finally:
        await server.stop()
        await engine.stop()
    costs = step_costs(engine)
    env = read(args.out, "env") or {}
    gb_s = env.get("bandwidth_gb_s") or copy_bandwidth(args.device, 0.0625 if args.cpu_dry_run else 2.0)
    for level in levels:
        if "steps" in level:
            level["limits"] = limits(level.pop("steps"), costs, gb_s, 1e12)
            level["bandwidth_fraction"] = level["tokens_per_s"] / level["limits"]["bandwidth_tokens_per_s"]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device_name(args.device),
        "model": model,
        "decode_step": args.route_decode if engine.decode_step is not None else "model",
        "compute_dtype": str(policy.compute_dtype).removeprefix("torch."),
        "new_tokens": new_tokens,
        "bandwidth_gb_s": gb_s,
        "step_costs": costs,
        "peak_vram_mib": torch.cuda.max_memory_allocated() / 2**20 if args.device != "cpu" else None,
        "levels": levels,
        "target": TARGETS["bandwidth_fraction_64_clients"],
        "cpu_dry_run": args.cpu_dry_run,
    }


def part_route(args: argparse.Namespace) -> None:
    data = asyncio.run(route_levels(args))
    write(args.out, "route", data, route_markdown(data))
    print(route_markdown(data))


def route_markdown(data: dict) -> str:
    lines = [
        f"# The route's decode on {data['device']}: `model={data['model']}`",
        "",
        f"{data['date']}. Greedy, {data['new_tokens']} new tokens per request (ignore_eos), one request per client, "
        f"all at once; decode step `{data['decode_step']}`, sampler weights {data['step_costs']['sampler_dtype']}. "
        f"Bandwidth limit: each decode step reading the sampler's weights "
        f"({data['step_costs']['weight_bytes'] / 2**20:.0f} MiB) and its KV cache once at the measured copy "
        f"bandwidth, {data['bandwidth_gb_s']:.0f} GB/s (bytes read + written). Written by bench/gpu_bench.py.",
        "",
        "| clients | tokens/s | bandwidth limit tokens/s | fraction of the limit |",
        "|---:|---:|---:|---:|",
    ]
    for level in data["levels"]:
        if "error" in level:
            lines.append(f"| {level['clients']} | {level['error']} | | |")
        else:
            lines.append(
                f"| {level['clients']} | {level['tokens_per_s']:.0f} | "
                f"{level['limits']['bandwidth_tokens_per_s']:.0f} | {level['bandwidth_fraction']:.3f} |"
            )
    lines += ["", f"Target (issue 38): at 64 clients, Qwen2.5-1.5B shape, >= {data['target']:.0%} of the limit."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- summary


def part_summary(args: argparse.Namespace) -> None:
    env, grpo, route = read(args.out, "env"), read(args.out, "grpo"), read(args.out, "route")
    lane = (args.out / "gpu_lane.md").read_text() if (args.out / "gpu_lane.md").is_file() else "not run\n"
    lines = [f"# GPU check: {env['device'] if env else 'unknown device'}", ""]
    if env:
        lines += [
            f"{env['date']}. CUDA {env['cuda']}; "
            + ", ".join(f"{k} {v}" for k, v in env["versions"].items())
            + f". Measured: copy bandwidth {env['bandwidth_gb_s']:.0f} GB/s (read + written), bf16 matmul "
            f"{env['bf16_tflop_s']:.0f} TFLOP/s ({env['bf16_matmul_n']}^3)."
            + (" CPU DRY RUN: toy sizes, no GPU figures." if env["cpu_dry_run"] else ""),
            "",
        ]
    lines += ["## The CUDA lane", "", lane.strip(), "", "## Targets", ""]
    if grpo:
        for shape, verdict in grpo["verdicts"].items():
            lines.append(f"- GRPO, {shape}: " + ", ".join(f"{k} = {v}" for k, v in verdict.items()))
    else:
        lines.append("- GRPO: not run")
    if route:
        at_64 = [lv for lv in route["levels"] if lv["clients"] == 64 and "bandwidth_fraction" in lv]
        fraction = f"{at_64[0]['bandwidth_fraction']:.3f}" if at_64 else "not measured"
        lines.append(
            f"- decode at 64 clients ({route['model']}): fraction of the bandwidth limit = {fraction} "
            f"(target {route['target']})"
        )
    else:
        lines.append("- route decode: not run")
    lines += ["", "Details: gpu_grpo.md, gpu_route.md, gpu_env.json."]
    (args.out / "gpu_summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["env", "grpo", "route", "summary"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", help="model.tokenizer: the embedded tokenizer's folder (export_tokenizer.py)")
    parser.add_argument("--cpu-dry-run", action="store_true", help="toy sizes on the CPU: a check of the script")
    parser.add_argument("--budget-s", type=float, default=150, help="this part's time budget")
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1, help="timed GRPO steps per system, after one warm-up")
    parser.add_argument("--route-shape", default="shape_qwen25_15b")
    parser.add_argument("--clients", type=int, nargs="+", default=CLIENTS)
    parser.add_argument("--route-tokens", type=int, default=64)
    parser.add_argument(
        "--route-decode", default="graph", choices=["graph", "fast", "model"], help="engine.decode of the route part"
    )
    args = parser.parse_args()
    if args.cpu_dry_run:
        args.device = "cpu"
    {"env": part_env, "grpo": part_grpo, "route": part_route, "summary": part_summary}[args.part](args)


if __name__ == "__main__":
    main()
