"""The route as a user starts it, two checkouts side by side: tokens/s at 1, 8, 32 and 64 clients.

Every arm is ``python harness.py algo=serve`` (the embedded model, no adapter, every call recorded in
its store as the serve job does) started from its own checkout, a ``git worktree`` of
``--baseline`` or this tree, each with its own defaults. This process is the clients: at each level,
``clients`` concurrent ``AsyncOpenAI`` clients send GSM8K test questions through the chat template
over HTTP, ``--new-tokens`` new tokens each (greedy, ``ignore_eos``), as ``bench/serve.py`` does.
Every round starts each arm's server afresh, in alternating order, and runs all levels on it after a
warm-up request. The server's peak RSS is its ``VmHWM`` when the round ends. A bf16 matmul probe runs
before and after, with no server up.

The default baseline, 637fd27, is the tree issue 13 was filed against ("aiming at 2x today's
tokens/s at 32 clients").

Writes bench/results/route_ab.md and .json.

    PYTHONPATH=. .venv/bin/python bench/route_ab.py                    # ~25 min on the 2-core AMX CPU
    PYTHONPATH=. .venv/bin/python bench/route_ab.py --clients 1 8 --new-tokens 16 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from agl.memory import active_allocator
from bench.common import RESULTS, matmul_probe
from bench.serve import gsm8k_messages, route_run

ROOT = Path(__file__).resolve().parent.parent
SERVING = re.compile(r"serving (http://\S+/v1) \(model '([^']+)'\)")


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


class Route:
    """One arm's ``harness.py algo=serve``, from start to SIGTERM."""

    def __init__(self, tree: Path, run_dir: Path) -> None:
        command = [sys.executable, "harness.py", "algo=serve", "server.port=0", f"hydra.run.dir={run_dir}"]
        # each arm's harness.py sets its own OpenMP wait policy (bench.serve's, imported here, is not theirs)
        env = {**{k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}, "PYTHONPATH": str(tree)}
        self.log = (run_dir.parent / f"{run_dir.name}.log").open("w")
        self.process = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        for line in self.process.stdout:
            self.log.write(line)
            if match := SERVING.search(line):
                self.base_url, self.model = match.groups()
                threading.Thread(
                    target=self.log.writelines, args=(self.process.stdout,), daemon=True
                ).start()  # a full pipe would block it
                return
        raise RuntimeError(f"the route at {tree} exited ({self.process.wait()}) before serving; see {self.log.name}")

    def peak_rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)
        self.log.close()


async def levels(route: Route, args: argparse.Namespace) -> dict[int, dict]:
    async with httpx.AsyncClient() as http:  # the route answers /v1/models once its engine runs
        (await http.get(f"{route.base_url}/models", timeout=60)).raise_for_status()
    await route_run(route.base_url, route.model, gsm8k_messages(2), 2, 4)  # warm-up
    runs = {}
    for clients in args.clients:
        work = gsm8k_messages(max(clients, args.min_requests))
        runs[clients] = await route_run(route.base_url, route.model, work, clients, args.new_tokens)
    return runs


def main(args: argparse.Namespace) -> dict:
    head = git("rev-parse", "--short", "HEAD")
    with tempfile.TemporaryDirectory() as scratch:
        baseline = Path(scratch) / "baseline"
        git("worktree", "add", "--detach", str(baseline), args.baseline)
        arms = {f"baseline {git('rev-parse', '--short', 'HEAD', cwd=baseline)}": baseline, f"this tree ({head}+)": ROOT}
        probes = [matmul_probe(torch.bfloat16)]
        runs: dict[str, list[dict]] = {name: [] for name in arms}
        try:
            for round_ in range(args.rounds):
                for name in list(arms) if round_ % 2 == 0 else list(arms)[::-1]:
                    route = Route(arms[name], Path(scratch) / f"{round_}_{len(runs[name])}_{name.split()[0]}")
                    try:
                        start = time.perf_counter()
                        by_level = asyncio.run(levels(route, args))
                        runs[name].append(
                            {
                                "levels": by_level,
                                "peak_rss_mib": route.peak_rss_mib(),
                                "malloc": active_allocator(route.process.pid),
                                "wall_s": time.perf_counter() - start,
                            }
                        )
                    finally:
                        route.stop()
                    print(
                        f"round {round_ + 1}, {name}: "
                        + ", ".join(f"{c}: {r['tokens_per_s']:.1f}" for c, r in by_level.items())
                        + " tok/s",
                        flush=True,
                    )
        finally:
            git("worktree", "remove", "--force", str(baseline))
        probes.append(matmul_probe(torch.bfloat16))
    base = next(iter(runs))
    table = []
    for clients in args.clients:
        row = {"clients": clients, "requests": max(clients, args.min_requests)}
        for name, arm_runs in runs.items():
            row[name] = statistics.median(r["levels"][clients]["tokens_per_s"] for r in arm_runs)
        row["ratios"] = {
            name: [
                r["levels"][clients]["tokens_per_s"] / b["levels"][clients]["tokens_per_s"]
                for r, b in zip(arm_runs, runs[base])
            ]
            for name, arm_runs in runs.items()
            if name != base
        }
        table.append(row)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
        "bf16_gflop_s_before_after": probes,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "arms": list(runs),
        "levels": table,
        "peak_rss_mib": {
            name: statistics.median(r["peak_rss_mib"] for r in arm_runs) for name, arm_runs in runs.items()
        },
        "malloc": {name: sorted({r["malloc"] for r in arm_runs}) for name, arm_runs in runs.items()},
        "runs": runs,
        "command": " ".join(sys.argv[1:]),
    }


def markdown(result: dict) -> str:
    base, *others = result["arms"]
    lines = [
        "# The route as `harness.py algo=serve` starts it, two checkouts side by side",
        "",
        f"{result['date']}, {result['machine']}; bf16 2048² matmul before/after: "
        f"{' / '.join(f'{p:.0f}' for p in result['bf16_gflop_s_before_after'])} GFLOP/s. GSM8K test questions, "
        f"{result['new_tokens']} new tokens each (greedy, `ignore_eos`), concurrent `AsyncOpenAI` clients over HTTP; "
        f"{result['rounds']} rounds, a fresh server per arm and round, arms alternated; "
        "medians, and the ratio's value in "
        "each round. Written by `bench/route_ab.py`.",
        "",
        "| clients | requests | "
        + " | ".join(f"{name} tok/s" for name in result["arms"])
        + "".join(f" | {name} / baseline | each round" for name in others)
        + " |",
        "|---:|---:|" + "---:|" * len(result["arms"]) + "---:|---|" * len(others),
    ]
    for row in result["levels"]:
        cells = [str(row["clients"]), str(row["requests"]), *(f"{row[name]:.1f}" for name in result["arms"])]
        for name in others:
            ratios = row["ratios"][name]
            cells += [f"**{statistics.median(ratios):.2f}**", ", ".join(f"{r:.2f}" for r in ratios)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Peak RSS of the server (median over rounds): "
        + ", ".join(f"{name} {mib:,.0f} MiB" for name, mib in result["peak_rss_mib"].items())
        + ". "
        "Its malloc: " + ", ".join(f"{name} {'/'.join(kinds)}" for name, kinds in result["malloc"].items()) + ".",
        "",
        f"`PYTHONPATH=. .venv/bin/python bench/route_ab.py {result['command']}`",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="637fd27", help="git revision of the baseline arm (default: issue 13's)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--min-requests", type=int, default=8, help="requests per level at least (fewer clients send them in turn)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="where route_ab.{md,json} go")
    args = parser.parse_args()
    result = main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "route_ab.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "route_ab.md").write_text(markdown(result))
    print(markdown(result))
