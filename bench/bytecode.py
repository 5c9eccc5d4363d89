"""A fresh process with and without the venv's bytecode: what writing it once saves every later process.

uv, unlike pip, installs no ``.pyc`` files by default; where the environment has ``PYTHONDONTWRITEBYTECODE=1``
(this machine's does) Python then never writes them either, and every process compiles torch's, transformers' and
the rest's sources again. `make` lets Python write the bytecode of what it imports (its ``unexport``), the
first time; this measures what that is worth. Both sides run in this venv with ``PYTHONDONTWRITEBYTECODE=1``,
alternated; "no bytecode" points Python's bytecode lookup at another directory (``PYTHONPYCACHEPREFIX``) that
holds the standard library's bytecode only (the interpreter's own, which a venv uv installed still has): so it
lacks the venv's and the checkout's.

    PYTHONPATH=. .venv/bin/python bench/bytecode.py --rounds 3

Writes bench/results/bytecode.md, and each round's times to bench/results/bytecode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

from common import RESULTS, ROOT, cpu, median_range

# what the test suite's processes do most: import the job's modules; run a one-step job on the tiny model
COMMANDS = {
    "the job's imports": ["-c", "import agl.jobs.grpo, agl.policy.load, agl.route.server, agl.report.plots"],
    "a one-step GRPO job on the tiny model": [
        str(ROOT / "harness.py"),
        "model=tiny",
        "task=hello",
        "algo=grpo",
        "progress=false",
        "algo.steps=1",
        "algo.batch_size=1",
        "algo.group_size=2",
        "algo.eval_every=0",
        "task.max_tokens=2",
        "task.eval_size=1",
    ],
}


def timed(args: list[str], env: dict, cwd: str) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{args[:2]} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    with tempfile.TemporaryDirectory() as prefix, tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "AGL_CACHE": os.path.join(work, "cache")}
        stdlib_only = {**env, "PYTHONPYCACHEPREFIX": prefix}  # children (runner processes) see it too
        # the standard library's bytecode into the prefix (some of its test files do not compile: not checked)
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "-j0", sysconfig.get_paths()["stdlib"]],
            env=stdlib_only,
            capture_output=True,
        )
        sides = {"bytecode": env, "no bytecode": stdlib_only}
        times: dict[tuple[str, str], list[float]] = {(c, s): [] for c in COMMANDS for s in sides}
        timed(COMMANDS["a one-step GRPO job on the tiny model"], env, work)  # builds the tiny model once
        for r in range(rounds):
            for command, args in COMMANDS.items():
                for side in sorted(sides, reverse=r % 2 == 1):  # each side first every other round
                    run_dir = [f"hydra.run.dir={work}/run-{r}-{side[:2]}"]
                    extra = run_dir if args[0].endswith("harness.py") else []
                    times[command, side].append(timed([*args, *extra], sides[side], work))
    lines = [
        "# A fresh process with and without the venv's bytecode",
        "",
        f"`PYTHONPATH=. .venv/bin/python bench/bytecode.py --rounds {rounds}`, both sides alternated, "
        f'`PYTHONDONTWRITEBYTECODE=1`; "no bytecode" has the standard library\'s only; wall seconds, '
        f"median [min, max] of the rounds. CPU: {cpu()}.",
        "",
        "| command | bytecode | no bytecode | ratio |",
        "|---|---:|---:|---:|",
    ]
    for command in COMMANDS:
        with_, without = times[command, "bytecode"], times[command, "no bytecode"]
        ratio = statistics.median(without) / statistics.median(with_)
        lines.append(f"| {command} | {median_range(with_, 2)} | {median_range(without, 2)} | {ratio:.2f}× |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bytecode.md").write_text(text)
    raw = {f"{command} / {side}": ts for (command, side), ts in times.items()}
    (RESULTS / "bytecode.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
