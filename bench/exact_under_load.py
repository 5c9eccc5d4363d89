"""The exactness tests, again and again, while other processes take the cores: does scheduling change what a
fp32 run computes?

    PYTHONPATH=. .venv/bin/python bench/exact_under_load.py [--iterations 20] [--load 2] [--tests ...]

Load: ``--load`` processes (default: one per core), each alternating torch matmuls and SQLite writes with
fsync, so the tests' processes lose their cores at any moment and wait on the disk. Each iteration runs the
tests in a fresh pytest process with its own ``--basetemp``; a failing iteration keeps its run dirs and gets a
diagnosis: the first step, rollout and LLM call whose recorded tokens differ from the reference run's.
Writes bench/results/exact_under_load.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT

TESTS = [
    "tests/test_reproducible.py",
    "tests/test_attach.py::test_runner_processes_run_the_same_job_and_stopping_any_process_costs_nothing",
]


def load(stop: multiprocessing.Event, seconds: float = 0.5) -> None:
    """Matmuls, then SQLite commits with fsync, until ``stop``."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(384, 384)
    db = Path(tempfile.mkdtemp(prefix="agl-load-")) / "load.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("CREATE TABLE t (x BLOB)")
    try:
        while not stop.is_set():
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                a = torch.tanh(a @ a)
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                conn.execute("INSERT INTO t VALUES (?)", (os.urandom(4096),))
                conn.commit()
            conn.execute("DELETE FROM t")
    finally:
        conn.close()
        shutil.rmtree(db.parent, ignore_errors=True)


def first_difference(reference: Path, other: Path) -> str:
    """Where two run dirs' recorded tokens first differ: (rollout, attempt, call) in id order."""
    sql = (
        "SELECT s.rollout_id, json_extract(r.metadata, '$.step'), json_extract(r.metadata, '$.eval_step'), "
        "s.sequence_id, s.name, s.response_token_ids, s.response_logprobs FROM spans s "
        "JOIN rollouts r USING (rollout_id) JOIN attempts a USING (attempt_id) "
        "WHERE a.status = 'succeeded' ORDER BY s.rollout_id, s.sequence_id"
    )
    rows = {}
    for name, run in (("reference", reference), ("other", other)):
        with sqlite3.connect(run / "store.sqlite") as conn:
            rows[name] = conn.execute(sql).fetchall()
    for a, b in zip(rows["reference"], rows["other"]):
        if a != b:
            return f"first differing span: rollout {a[0]} (step {a[1]}, eval_step {a[2]}), call {a[3]} {a[4]}"
    if len(rows["reference"]) != len(rows["other"]):
        return f"{len(rows['reference'])} spans against {len(rows['other'])}"
    return "the same recorded tokens: the difference is in the update"


def diagnose(basetemp: Path) -> list[str]:
    """For each run dir under ``basetemp`` that has an adapter different from the reference's, where it differs."""
    refs = list(basetemp.rglob("reference*/run/adapter/adapter_model.safetensors"))
    if not refs:
        return ["no reference run found"]
    reference = refs[0].parents[1]
    found = []
    for adapter in basetemp.rglob("adapter/adapter_model.safetensors"):
        run = adapter.parent.parent
        if run != reference and adapter.read_bytes() != refs[0].read_bytes() and (run / "store.sqlite").is_file():
            found.append(f"{run.relative_to(basetemp)}: {first_difference(reference, run)}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--load", type=int, default=os.cpu_count())
    parser.add_argument("--tests", nargs="+", default=TESTS)
    parser.add_argument("--keep", default=str(ROOT / "outputs" / "exact_under_load"), help="failing iterations' dirs")
    args = parser.parse_args()

    stop = multiprocessing.Event()
    loaders = [multiprocessing.Process(target=load, args=(stop,), daemon=True) for _ in range(args.load)]
    for p in loaders:
        p.start()
    iterations, started = [], time.time()
    try:
        for i in range(args.iterations):
            iterations.append(run_iteration(i, args.tests, Path(args.keep)))
            print(json.dumps(iterations[-1]), flush=True)
            write_results(args, iterations, started)  # after each one: a run stopped early keeps its record
    finally:
        stop.set()
        for p in loaders:
            p.join(timeout=10)
    passed = sum(r["passed"] for r in iterations)
    print(f"{passed} of {len(iterations)} passed; bench/results/exact_under_load.md")


def run_iteration(i: int, tests: list[str], keep: Path) -> dict:
    """The tests once, in a fresh pytest process with its own ``--basetemp``; a failure's dirs are kept."""
    basetemp = Path(tempfile.mkdtemp(prefix=f"agl-exact-{i}-"))
    t0 = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}", *tests],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    record = {"iteration": i, "passed": result.returncode == 0, "seconds": round(time.time() - t0, 1)}
    record["summary"] = (result.stdout.strip().splitlines() or [""])[-1]
    if result.returncode != 0:
        record["failures"] = [line for line in result.stdout.splitlines() if line.startswith("FAILED")]
        record["diagnosis"] = diagnose(basetemp)
        kept = keep / f"iteration-{i}"
        shutil.copytree(basetemp, kept, dirs_exist_ok=True)
        (kept / "pytest.log").write_text(result.stdout + result.stderr)
        record["kept"] = str(kept)
    shutil.rmtree(basetemp, ignore_errors=True)
    return record


def write_results(args: argparse.Namespace, iterations: list[dict], started: float) -> None:
    passed = sum(r["passed"] for r in iterations)
    out = {
        "tests": args.tests,
        "load_processes": args.load,
        "cores": os.cpu_count(),
        "iterations": iterations,
        "passed": passed,
        "wall_s": round(time.time() - started, 1),
        "date": time.strftime("%Y-%m-%d"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "exact_under_load.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [
        "# exactness tests under load",
        "",
        f"`PYTHONPATH=. python bench/exact_under_load.py --iterations {args.iterations} --load {args.load}`, "
        f"{out['date']}, {os.cpu_count()} cores, {args.load} load processes (matmuls + fsynced SQLite writes)",
        "",
        f"**{passed} of {len(iterations)} iterations passed** (of {args.iterations} asked), each running: "
        + ", ".join(f"`{t}`" for t in args.tests),
        "",
        "| iteration | passed | seconds | summary |",
        "|---|---|---|---|",
        *[f"| {r['iteration']} | {r['passed']} | {r['seconds']} | {r['summary']} |" for r in iterations],
    ]
    for r in iterations:
        if not r["passed"]:
            lines += ["", f"iteration {r['iteration']}: " + "; ".join(r["failures"] + r["diagnosis"])]
    (RESULTS / "exact_under_load.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
