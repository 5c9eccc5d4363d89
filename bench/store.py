"""Benchmark of SqliteStore: is every operation flat in the size of the store? And what does a call through
the store served over HTTP (agl/store/server.py, agl.StoreClient) cost beside a local one?

    .venv/bin/python bench/store.py [--sizes 1000,10000,100000] [--ops 2000]
    .venv/bin/python bench/store.py --client [--sizes 10000] [--ops 1000] [--in-flight 1,16]

For each size N, in a fresh subprocess (so that peak RSS is per size):
  1. prefill a store file to N rollouts through the public API: N enqueued in
     batches (`enqueue_rollouts`), and 10% of them run through a whole life
     (dequeue, one LLM span, finish) so attempts and spans exist too;
  2. time `--ops` single operations of each kind, one after the other, each
     awaited (one op = one call; no batching), in `--rounds` rounds:
       enqueue   enqueue_rollout
       dequeue   dequeue_rollout            (the queue holds ~0.9 N rollouts)
       add_span  add_span, an "llm.chat" span with 200 prompt ids, 200 response
                 ids and 200 logprobs
       finish    update_attempt(status="succeeded")
  3. record ops/s (best round: the machine is shared, the best round is the
     least disturbed one; the median round too), ops per CPU-second (both
     threads counted; robust to contention), the peak RSS of the process and
     the file size (db + WAL).

Targets (issue 3): >= 2,000 dequeues/s and finishes/s at every size, flat
within 2x from the smallest to the largest size; >= 5,000 spans/s.
Results: bench/results/store.md (table) and bench/results/store.json (raw).

`--client` measures the same operations on the same prefilled store twice, side by side, in one run: through
the local store, then through a `StoreClient` over a real socket to a `StoreServer` in a process of its own
(as a runner on another host reaches it; here both on this machine, over the loopback), each with 1 call in
flight (each awaited) and with 16 (16 tasks issuing them, as a runner process's runners do). The probes of
the machine (bench/common.py: a 2048² float32 matmul and a 1 GiB sum) are taken in the same run. Results:
bench/results/store_client.md and .json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("enqueue", "dequeue", "add_span", "finish")
TARGETS = {"dequeue": 2000.0, "finish": 2000.0, "add_span": 5000.0}
PREFILL_BATCH = 1000
LIFECYCLE_FRACTION = 0.10


def llm_span(attempted, tokens: list[int], logprobs: list[float]):
    from agl.types import Span

    return Span(
        rollout_id=attempted.rollout_id,
        attempt_id=attempted.attempt.attempt_id,
        name="llm.chat",
        prompt_token_ids=tokens,
        response_token_ids=tokens,
        response_logprobs=logprobs,
        attributes={"policy_version": 1, "finish_reason": "stop"},
    )


async def prefill(store, size: int, tokens: list[int], logprobs: list[float]) -> None:
    for start in range(0, size, PREFILL_BATCH):
        n = min(PREFILL_BATCH, size - start)
        await store.enqueue_rollouts(
            [{"question": f"q{start + i}"} for i in range(n)],
            mode="train",
            metadata=[{"step": (start + i) // 64} for i in range(n)],
        )
    for _ in range(int(size * LIFECYCLE_FRACTION)):
        attempted = await store.dequeue_rollout(worker_id="prefill")
        await store.add_span(llm_span(attempted, tokens[:20], logprobs[:20]))
        await store.update_attempt(attempted.rollout_id, attempted.attempt.attempt_id, status="succeeded")


async def in_flight(n: int, calls: list) -> None:
    """Run the zero-argument coroutine functions ``calls``, ``n`` at a time (n tasks taking the next one)."""
    pending = iter(calls)

    async def worker() -> None:
        for call in pending:
            await call()

    await asyncio.gather(*(worker() for _ in range(n)))


async def measure(store, ops: int, n_rounds: int, tokens: list[int], logprobs: list[float], flight: int) -> dict:
    """``n_rounds`` rounds of ``ops`` calls of each operation, ``flight`` in flight: best and median round
    (wall), and the rate per CPU-second of this process."""
    rounds: dict[str, list[tuple[float, float]]] = {op: [] for op in OPS}

    def clock() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def record(op: str, start: tuple[float, float]) -> None:
        wall, cpu = clock()
        rounds[op].append((ops / (wall - start[0]), ops / max(cpu - start[1], 1e-9)))

    for round_ in range(n_rounds):
        start = clock()
        await in_flight(
            flight,
            [
                lambda i=i: store.enqueue_rollout(
                    {"question": f"new{round_}-{i}"}, mode="train", metadata={"step": 10**6}
                )
                for i in range(ops)
            ],
        )
        record("enqueue", start)
        attempted_list: list = []

        async def dequeue() -> None:
            attempted_list.append(await store.dequeue_rollout(worker_id="bench"))

        start = clock()
        await in_flight(flight, [dequeue] * ops)
        record("dequeue", start)
        assert all(a is not None for a in attempted_list)
        spans = [llm_span(a, tokens, logprobs) for a in attempted_list]  # built outside the timing
        start = clock()
        await in_flight(flight, [lambda span=span: store.add_span(span) for span in spans])
        record("add_span", start)
        start = clock()
        await in_flight(
            flight,
            [
                lambda a=a: store.update_attempt(a.rollout_id, a.attempt.attempt_id, status="succeeded")
                for a in attempted_list
            ],
        )
        record("finish", start)
    return {
        "ops_per_second": {op: max(w for w, _ in rs) for op, rs in rounds.items()},
        "median_ops_per_second": {op: statistics.median(w for w, _ in rs) for op, rs in rounds.items()},
        "cpu_ops_per_second": {op: statistics.median(c for _, c in rs) for op, rs in rounds.items()},
        "rounds": rounds,
    }


def serve(path: str) -> None:
    """``--serve PATH``: the store server of ``--client``, a process of its own: prints its URL, serves until
    stdin closes."""
    from agl.store import SqliteStore
    from agl.store.server import StoreServer

    async def main() -> None:
        async with SqliteStore(path, watchdog_interval=1.0) as store:
            async with StoreServer(store, port=0) as server:
                print(server.url, flush=True)
                await asyncio.to_thread(sys.stdin.read)

    asyncio.run(main())


async def run_client_comparison(size: int, ops: int, n_rounds: int, directory: Path, flights: list[int]) -> dict:
    """The same store, local then through a client of its server (another process), at each of ``flights``."""
    from agl.store import SqliteStore, StoreClient

    path = directory / f"store-client-{size}.sqlite"
    tokens, logprobs = list(range(1000, 1200)), [-0.5] * 200
    result: dict = {"size": size, "ops": ops, "rounds_run": n_rounds, "local": {}, "client": {}}
    store = SqliteStore(path, watchdog_interval=None)
    try:
        await prefill(store, size, tokens, logprobs)
        for flight in flights:
            result["local"][flight] = await measure(store, ops, n_rounds, tokens, logprobs, flight)
    finally:
        await store.close()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        url = server.stdout.readline().strip()
        async with StoreClient(url) as client:
            for flight in flights:
                result["client"][flight] = await measure(client, ops, n_rounds, tokens, logprobs, flight)
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    result["load_average"] = os.getloadavg()
    return result


async def run_size(size: int, ops: int, n_rounds: int, directory: Path) -> dict:
    from agl.store import SqliteStore

    path = directory / f"store-{size}.sqlite"
    store = SqliteStore(path, watchdog_interval=None)
    tokens = list(range(1000, 1200))
    logprobs = [-0.5] * 200
    result: dict = {"size": size, "ops": ops, "rounds_run": n_rounds}
    try:
        t0 = time.perf_counter()
        await prefill(store, size, tokens, logprobs)
        result["prefill_seconds"] = time.perf_counter() - t0
        measured = await measure(store, ops, n_rounds, tokens, logprobs, 1)
        rates = measured["ops_per_second"]
        result["median_ops_per_second"] = measured["median_ops_per_second"]
        result["cpu_ops_per_second"] = measured["cpu_ops_per_second"]
        result["rounds"] = measured["rounds"]
        result["load_average"] = os.getloadavg()
        result["ops_per_second"] = rates
    finally:
        await store.close()

    conn = sqlite3.connect(path)
    result["rollouts"] = conn.execute("SELECT count(*) FROM rollouts").fetchone()[0]
    result["spans"] = conn.execute("SELECT count(*) FROM spans").fetchone()[0]
    conn.close()
    result["file_bytes"] = sum(p.stat().st_size for p in directory.glob(f"store-{size}.sqlite*"))
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def run_in_subprocess(size: int, ops: int, n_rounds: int, directory: Path) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--single",
            str(size),
            "--ops",
            str(ops),
            "--rounds",
            str(n_rounds),
            "--dir",
            str(directory),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def render(results: list[dict]) -> str:
    sizes = [r["size"] for r in results]
    head = "| op | " + " | ".join(f"{s:,} rollouts" for s in sizes) + " | max/min | target |"
    lines = [head, "|" + "---|" * (len(sizes) + 3)]
    for op in OPS:
        rates = [r["ops_per_second"][op] for r in results]
        target = TARGETS.get(op)
        ok = target is None or min(rates) >= target
        flat = max(rates) / min(rates)
        if op in ("dequeue", "finish"):
            ok = ok and flat <= 2.0
        target_text = (
            "-" if target is None else f"≥{target:,.0f}/s" + (", flat ≤2×" if op in ("dequeue", "finish") else "")
        )
        lines.append(
            f"| {op} (ops/s) | "
            + " | ".join(f"{x:,.0f}" for x in rates)
            + f" | {flat:.2f} | {target_text} {'✅' if ok else '❌'} |"
        )
    for op in OPS:
        lines.append(
            f"| {op}, median round (ops/s) | "
            + " | ".join(f"{r['median_ops_per_second'][op]:,.0f}" for r in results)
            + " | | |"
        )
    for op in OPS:
        lines.append(
            f"| {op}, per CPU-second | " + " | ".join(f"{r['cpu_ops_per_second'][op]:,.0f}" for r in results) + " | | |"
        )
    lines.append("| load average (1 min) | " + " | ".join(f"{r['load_average'][0]:.1f}" for r in results) + " | | |")
    lines.append("| peak RSS (MiB) | " + " | ".join(f"{r['peak_rss_bytes'] / 2**20:,.0f}" for r in results) + " | | |")
    lines.append("| file size (MiB) | " + " | ".join(f"{r['file_bytes'] / 2**20:,.1f}" for r in results) + " | | |")
    lines.append("| prefill (s) | " + " | ".join(f"{r['prefill_seconds']:,.1f}" for r in results) + " | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--ops", type=int, default=2000, help="ops per op kind per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per size; the best is reported")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--dir", type=Path, default=None, help="where the store files go (default: a temp dir)")
    parser.add_argument("--client", action="store_true", help="local store vs StoreClient over HTTP, side by side")
    parser.add_argument("--in-flight", default="1,16", help="--client: calls in flight (each is measured)")
    parser.add_argument("--single", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.serve is not None:
        serve(args.serve)
        return
    if args.single is not None:
        print(json.dumps(asyncio.run(run_size(args.single, args.ops, args.rounds, args.dir))))
        return
    if args.client:
        client_comparison(args)
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="agl-store-bench-", dir=args.dir) as tmp:
        results = []
        for size in sizes:  # one at a time: the machine is shared
            print(f"size {size:,} ...", file=sys.stderr, flush=True)
            results.append(run_in_subprocess(size, args.ops, args.rounds, Path(tmp)))
            print("  " + json.dumps(results[-1]["ops_per_second"]), file=sys.stderr, flush=True)

    env = {
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store.json").write_text(json.dumps({"env": env, "results": results}, indent=2) + "\n")
    table = render(results)
    md = (
        "# SqliteStore benchmark\n\n"
        f"`{Path(sys.executable).name} bench/store.py --sizes {args.sizes} --ops {args.ops}` — "
        f"Python {env['python']}, SQLite {env['sqlite']}, {env['cpus']} CPUs ({env['machine']}), {env['date']}.\n\n"
        "Each column is a store prefilled to that many rollouts (10% of them run through a full life, the rest\n"
        f"queued), then {args.rounds} rounds of {args.ops:,} single awaited calls of each operation; WAL,\n"
        'synchronous=NORMAL, file on disk. Rows "(ops/s)": best round, wall clock. The machine is shared\n'
        "with other jobs (see the load average), so the median round and the CPU-time rate are shown too.\n"
        "add_span writes an `llm.chat` span with 200 prompt ids, 200 response ids and 200 logprobs.\n"
        f"Each round enqueues {args.ops:,} more rollouts, so a store grows by rounds × ops while measured.\n\n"
        + table
        + "\n"
    )
    (args.out / "store.md").write_text(md)
    print(md)


def client_comparison(args: argparse.Namespace) -> None:
    """``--client``: bench/results/store_client.{md,json}."""
    import torch

    from bench.common import cpu, matmul_probe, memory_probe

    flights = [int(f) for f in args.in_flight.split(",")]
    probes = {"gflop_s_fp32": matmul_probe(torch.float32), "gb_s": memory_probe()}
    with tempfile.TemporaryDirectory(prefix="agl-store-bench-", dir=args.dir) as tmp:
        results = [
            asyncio.run(run_client_comparison(int(size), args.ops, args.rounds, Path(tmp), flights))
            for size in args.sizes.split(",")
        ]
    probes = {k: max(v, f()) for (k, v), f in zip(probes.items(), (lambda: matmul_probe(torch.float32), memory_probe))}
    env = {
        "cpu": cpu(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "probes": probes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_client.json").write_text(json.dumps({"env": env, "results": results}, indent=2) + "\n")
    lines = [
        "# The store through its HTTP client, beside the local store",
        "",
        f"`{Path(sys.executable).name} bench/store.py --client --sizes {args.sizes} --ops {args.ops} "
        f"--rounds {args.rounds} --in-flight {args.in_flight}`: {env['cpu']}; probes (best of before and after, "
        f"same run): float32 matmul {probes['gflop_s_fp32']:,.0f} GFLOP/s, memory {probes['gb_s']:.1f} GB/s; "
        f"Python {env['python']}, SQLite {env['sqlite']}, {env['date']}.",
        "",
        "The same prefilled store (10% of its rollouts through a full life), each operation measured through the",
        "local store in this process, then through `agl.StoreClient` over a TCP socket (the loopback) to a",
        "`StoreServer` in a process of its own, with 1 call in flight (each awaited) and with 16 (16 tasks). Best",
        f"round of {args.rounds}, ops/s (wall clock); the machine is shared (load average beside).",
        "",
    ]
    for r in results:
        lines += [
            f"{r['size']:,} rollouts (load average {r['load_average'][0]:.1f}):",
            "",
            "| op | "
            + " | ".join(f"local, {f} in flight | client, {f} in flight | client/local" for f in flights)
            + " |",
            "|---|" + "---|---|---|" * len(flights),
        ]
        for op in OPS:
            cells = []
            for f in flights:
                local, remote = r["local"][f]["ops_per_second"][op], r["client"][f]["ops_per_second"][op]
                cells.append(f"{local:,.0f} | {remote:,.0f} | {remote / local:.2f}")
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
        lines.append("")
    md = "\n".join(lines)
    (args.out / "store_client.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
