"""A soak: many rollouts through the route and the runners, watching what a long run would leak.

    PYTHONPATH=. python bench/soak.py --rollouts 2000            # a short check (minutes)
    PYTHONPATH=. python bench/soak.py --rollouts 26000 --warmup 6000   # the full soak (BENCHMARKS.md)
    PYTHONPATH=. python bench/soak.py --by-url 4 --rollouts 3000 --suffix _url   # runners joined by URL

One process as a job runs it (``agl.runtime.Runtime``): the store, the tiny policy's engine, the route and
64 runners (``--runners``), whose agents (bench/soak_agent.py) hold multi-turn chats with a tool, 1 row in
16 failing and 1 in 32 hanging until its attempt times out, on purpose. Rollouts go in rounds of
``--round``; after each round the process's RSS, open file descriptors, threads and the store's size on disk
(file + WAL) are sampled, with the round's p50/p99 latency of an LLM call (seen by the agent) and of a
rollout (start to end). After the warm-up the targets are checked: RSS grows by less than 1 MiB per 1,000
rollouts (least-squares slope), fds and threads stay constant (no trend, and no more spread than a sample
catches in flight: ``TRANSIENT``), the store grows linearly (bytes per rollout of the first and second half
within 10 %). Writes bench/results/soak{suffix}.{json,md,png}.

``--by-url N``: the store is served by a process of its own (``python harness.py algo=store``), the job uses it by
``store.url``, and its runners are N runner processes (``runner.processes``) joined by that URL, 64 / N each
(the route on the job's loopback). Sampled then: the whole tree (job, runner processes, store server), each
process's RSS, fds and threads summed, and each role's apart; a call's latency is its span's (the route's). Also
checked: nothing lost (every rollout of a round ends, and each was handed out once: one attempt, none retried).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import soak_agent
from common import RESULTS, ROOT, model_config

from agl.config import RunnerConfig, ServerConfig, StoreConfig
from agl.runtime import Runtime

TRANSIENT = 4  # fds or threads a sample may catch in flight (a socket closing, an agent's loop thread ending)
# --by-url: the tree's fds also hold what each of the 64 rollouts has in flight, a connection to the route and one to
# the store; a sample catches any number of them, so the range allowed is that much wider (the trend is what counts)
IN_FLIGHT_FDS_PER_RUNNER = 2


def sample(run_dir: Path, store_dir: Path | None = None, server: psutil.Process | None = None) -> dict:
    """RSS, open fds and threads of this process, or (``--by-url``) of every process of the soak summed, and
    each role's; the store's size on disk."""
    store = sum(p.stat().st_size for p in (store_dir or run_dir).glob("store.sqlite*") if p.name != "store.sqlite-shm")
    roles = {"job": [psutil.Process()]}
    if server is not None:
        roles["runners"] = [p for p in psutil.Process().children() if p.pid != server.pid]  # the job's runners
        roles["store"] = [server]
    row: dict = {"store_bytes": store}
    for role, procs in roles.items():
        row[role] = {
            "rss_mib": sum(p.memory_info().rss for p in procs) / 2**20,
            "fds": sum(p.num_fds() for p in procs),
            "threads": sum(p.num_threads() for p in procs),
            "processes": len(procs),
        }
    for key in ("rss_mib", "fds", "threads"):
        row[key] = sum(r[key] for r in row.values() if isinstance(r, dict))
    return row


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def serve_store(store_dir: Path) -> tuple[subprocess.Popen, str]:
    """``--by-url``: ``python harness.py algo=store`` on a free port; its process and URL."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "harness.py"), "algo=store", "store.port=0", f"hydra.run.dir={store_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in proc.stdout:
        if found := re.search(r"store\.url=(http://\S+)\)", line):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # its later lines: read, never blocking it
            return proc, found.group(1)
    raise RuntimeError(f"the store server did not start (exit {proc.wait()})")


async def call_latencies(store, rollouts: list) -> list[float]:
    """Seconds per LLM call of these rollouts, as the route recorded them (its spans)."""
    spans = await asyncio.gather(*(store.query_spans(r.rollout_id) for r in rollouts))
    return [s.end_time - s.start_time for ss in spans for s in ss if s.name.startswith("llm.") and s.end_time]


TERMINAL = ("succeeded", "failed", "cancelled")


def lost_in(sample: dict, before: dict) -> int:
    """Rollouts of the round ending at ``sample`` that did not end: the round's size less its terminal ones (an
    `ok` row may fail too, by the attempt's timeout on a loaded machine: that is not a loss)."""
    ended = sum(n for status, n in (sample.get("statuses") or {}).items() if status in TERMINAL)
    return sample["rollouts"] - before["rollouts"] - ended


def handed_out_twice(store_file: Path) -> int | None:
    """Rollouts with more than one attempt (the soak kills nothing and retries nothing: each is dequeued once),
    or fewer than one; None without the store's file."""
    if not store_file.is_file():
        return None
    with sqlite3.connect(f"file:{store_file}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT count(*) FROM rollouts WHERE num_attempts != 1").fetchone()[0]


async def soak(args: argparse.Namespace, run_dir: Path) -> list[dict]:
    by_url = args.by_url > 0
    server, store_dir, store = None, None, StoreConfig()
    if by_url:
        store_dir = run_dir / "store"
        server_proc, url = serve_store(store_dir)
        server = psutil.Process(server_proc.pid)
        store = StoreConfig(url=url)
        runner = RunnerConfig(
            n=0,
            processes=args.by_url,
            per_process=args.runners // args.by_url,
            timeout_seconds=args.timeout,
            max_attempts=1,
        )
    else:
        runner = RunnerConfig(n=args.runners, timeout_seconds=args.timeout, max_attempts=1)
    rt = Runtime(
        run_dir,
        task={"name": "soak", "agent": "soak_agent:soak_agent", "data": "soak_agent:load"},
        model=model_config("tiny"),
        runner=runner,
        server=ServerConfig(),
        store=store,
        seed=0,
        device="cpu",
        progress=False,
    )
    try:
        return await soak_rounds(args, rt, run_dir, store_dir, server)
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            server.wait(60)


async def soak_rounds(args, rt: Runtime, run_dir: Path, store_dir: Path | None, server) -> list[dict]:
    rows = rt.task.load("train")
    samples: list[dict] = []
    started = time.perf_counter()
    async with rt:
        resources_id = await rt.resources_id({})
        done = 0
        samples.append({"rollouts": 0, "seconds": 0.0, **sample(run_dir, store_dir, server)})
        while done < args.rollouts:
            n = min(args.round, args.rollouts - done)
            batch = [rows[(done + i) % len(rows)] for i in range(n)]
            soak_agent.LATENCIES.clear()
            rollouts = await rt.run_rollouts(
                batch, [{"soak": done + i} for i in range(n)], mode="train", resources_id=resources_id
            )
            done += n
            spans = [r.end_time - r.start_time for r in rollouts if r.end_time is not None]
            calls = list(soak_agent.LATENCIES) if server is None else await call_latencies(rt.store, rollouts)
            statuses: dict[str, int] = {}
            for r in rollouts:
                statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
            row = {
                "rollouts": done,
                "seconds": time.perf_counter() - started,
                **sample(run_dir, store_dir, server),
                "call_p50_s": quantile(calls, 0.5),
                "call_p99_s": quantile(calls, 0.99),
                "rollout_p50_s": quantile(spans, 0.5),
                "rollout_p99_s": quantile(spans, 0.99),
                "statuses": statuses,
            }
            samples.append(row)
            print(
                f"{done:>7} rollouts {row['seconds']:7.0f} s  rss {row['rss_mib']:7.1f} MiB  fds {row['fds']:4d}  "
                f"threads {row['threads']:3d}  store {row['store_bytes'] / 2**20:7.1f} MiB  "
                f"call p50/p99 {row['call_p50_s'] or 0:.3f}/{row['call_p99_s'] or 0:.3f} s  {statuses}",
                flush=True,
            )
    return samples


def probes() -> dict:
    """The machine's probes, taken with the soak's figures (bench/common.py)."""
    import torch
    from common import cpu, matmul_probe, memory_probe

    return {"cpu": cpu(), "gflop_s_fp32": round(matmul_probe(torch.float32)), "gb_s": round(memory_probe(), 1)}


def verdict(samples: list[dict], warmup: int, in_flight_fds: int = 0, store_file: Path | None = None) -> dict:
    after = [s for s in samples if s["rollouts"] >= warmup]
    if len(after) < 3:
        return {"checked": False, "why": f"fewer than 3 samples after the warm-up ({warmup} rollouts)"}
    xs = [s["rollouts"] / 1000 for s in after]
    rss_slope = slope(xs, [s["rss_mib"] for s in after])
    half = len(after) // 2
    first, second = after[: half + 1], after[half:]

    def bytes_per_rollout(part: list[dict]) -> float:
        return (part[-1]["store_bytes"] - part[0]["store_bytes"]) / max(part[-1]["rollouts"] - part[0]["rollouts"], 1)

    per_first, per_second = bytes_per_rollout(first), bytes_per_rollout(second)
    fds = sorted({s["fds"] for s in after})
    threads = sorted({s["threads"] for s in after})

    def constant(values: list[int], in_flight: int = 0) -> bool:
        """No trend, and no more spread than what is in flight at a sample (a closing socket, a loop's thread;
        ``in_flight`` more: the connections of the rollouts running): slope under 1 per 1,000 rollouts and a range
        of at most 4 (+ ``in_flight``)."""
        return abs(slope(xs, values)) < 1.0 and max(values) - min(values) <= TRANSIENT + in_flight

    lost_total = sum(lost_in(sample, before) for before, sample in zip(samples, samples[1:]))
    twice = handed_out_twice(store_file) if store_file is not None else None
    return {
        "checked": True,
        "lost": lost_total,
        "handed_out_not_once": twice,
        "nothing_lost_ok": lost_total == 0 and twice in (0, None),
        "warmup_rollouts": warmup,
        "rss_mib_per_1000_rollouts": round(rss_slope, 3),
        "rss_ok": rss_slope < 1.0,
        "fds_seen": fds,
        "fds_slope_per_1000_rollouts": round(slope(xs, [s["fds"] for s in after]), 3),
        "fds_ok": constant([s["fds"] for s in after], in_flight_fds),
        "threads_seen": threads,
        "threads_ok": constant([s["threads"] for s in after]),
        "store_bytes_per_rollout": [round(per_first), round(per_second)],
        "store_linear_ok": abs(per_second - per_first) <= 0.1 * max(per_first, 1),
    }


def plot(samples: list[dict], warmup: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["rollouts"] for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [
        (axes[0][0], "RSS (MiB)", [("rss", [s["rss_mib"] for s in samples])]),
        (
            axes[0][1],
            "open fds / threads",
            [("fds", [s["fds"] for s in samples]), ("threads", [s["threads"] for s in samples])],
        ),
        (axes[1][0], "store on disk (MiB)", [("store + WAL", [s["store_bytes"] / 2**20 for s in samples])]),
        (
            axes[1][1],
            "LLM call latency (s)",
            [("p50", [s.get("call_p50_s") for s in samples]), ("p99", [s.get("call_p99_s") for s in samples])],
        ),
    ]
    for ax, title, lines in panels:
        for label, ys in lines:
            ax.plot(xs, [float("nan") if y is None else y for y in ys], label=label)
        ax.axvline(warmup, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.legend(loc="best", fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("rollouts")
    fig.suptitle("soak: 64 agents on the tiny model (dotted: end of warm-up)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=None, help="rollouts before the targets apply (default: 10 %%)")
    parser.add_argument("--runners", type=int, default=64)
    parser.add_argument("--by-url", type=int, default=0, help="runner processes joined by the store's URL (0: none)")
    parser.add_argument("--round", type=int, default=128, help="rollouts between samples")
    parser.add_argument("--timeout", type=int, default=30, help="seconds per attempt (the hanging rows' end)")
    parser.add_argument("--suffix", default="", help="results file suffix: soak{suffix}.json")
    parser.add_argument("--run-dir", default=None, help="where the store goes (default: a fresh dir under /tmp)")
    parser.add_argument("--from-json", default=None, help="recompute the verdict, table and plot of a saved soak")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else args.rollouts // 10
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        samples, warmup = result["samples"], result["verdict"].get("warmup_rollouts", warmup)
        args.rollouts, args.runners = result["rollouts"], result["runners"]
        result.setdefault("by_url", 0)
        result.setdefault("run_dir", args.run_dir or "")
    else:
        run_dir = Path(args.run_dir or f"/tmp/agl-soak-{os.getpid()}")
        run_dir.mkdir(parents=True, exist_ok=True)
        here = str(Path(__file__).resolve().parent)  # runner processes import the soak's agent from bench/
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        samples = asyncio.run(soak(args, run_dir))
        result = {
            "command": "PYTHONPATH=. python bench/soak.py " + " ".join(sys.argv[1:]),
            "machine": f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "rollouts": args.rollouts,
            "runners": args.runners,
            "by_url": args.by_url,
            "run_dir": str(run_dir),
            "probes": probes(),
        }
    in_flight_fds = IN_FLIGHT_FDS_PER_RUNNER * args.runners if result.get("by_url") else 0
    store_file = Path(result["run_dir"]) / ("store" if result.get("by_url") else "") / "store.sqlite"
    result = {**result, "verdict": verdict(samples, warmup, in_flight_fds, store_file), "samples": samples}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"soak{args.suffix}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(samples, warmup, stem.with_suffix(".png"))
    v = result["verdict"]
    last = samples[-1]
    joined = f", in {result['by_url']} runner processes joined by the store's URL" if result.get("by_url") else ""
    machine = result.get("probes") or {}
    probed = (
        f"; {machine['cpu']}, float32 matmul {machine['gflop_s_fp32']} GFLOP/s, memory {machine['gb_s']} GB/s"
        if machine
        else ""
    )
    lines = [
        f"# Soak: {args.rollouts} rollouts, {args.runners} agents{joined}, tiny model",
        "",
        f"`{result['command']}` ({result['date']}, {result['machine']}{probed}): {last['seconds']:.0f} s, "
        f"{args.rollouts / last['seconds']:.1f} rollouts/s. Curves: `{stem.with_suffix('.png').relative_to(ROOT)}`.",
        "",
    ]
    if v["checked"]:
        lines += [
            f"After the warm-up ({warmup} rollouts):",
            "",
            "| target | measured | met |",
            "| --- | --- | --- |",
            f"| nothing lost (every rollout of a round ends; each handed out once) | {v['lost']} not ended, "
            f"{v['handed_out_not_once']} handed out other than once | {v['nothing_lost_ok']} |",
            f"| RSS grows < 1 MiB per 1,000 rollouts | {v['rss_mib_per_1000_rollouts']} MiB | {v['rss_ok']} |",
            f"| open fds constant (no trend; range within {TRANSIENT + in_flight_fds}) | {v['fds_seen'][0]}-"
            f"{v['fds_seen'][-1]}, slope {v['fds_slope_per_1000_rollouts']} per 1,000 | {v['fds_ok']} |",
            f"| threads constant | {v['threads_seen']} | {v['threads_ok']} |",
            f"| store linear (bytes/rollout, 1st vs 2nd half) | {v['store_bytes_per_rollout']} "
            f"| {v['store_linear_ok']} |",
        ]
    else:
        lines.append(f"Targets not checked: {v['why']}.")
    lines += [
        "",
        f"Last round: RSS {last['rss_mib']:.1f} MiB, {last['fds']} fds, {last['threads']} threads, store "
        f"{last['store_bytes'] / 2**20:.1f} MiB, LLM call p50/p99 {last['call_p50_s'] or 0:.3f}/"
        f"{last['call_p99_s'] or 0:.3f} s, rollout p50/p99 {last['rollout_p50_s'] or 0:.2f}/"
        f"{last['rollout_p99_s'] or 0:.2f} s.",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
