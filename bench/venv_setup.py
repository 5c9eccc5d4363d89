"""`make test`'s setup (the torch wheel and the three venvs) from a fresh clone: this repository's HEAD against
another commit, side by side (commits, so uncommitted changes are not measured).

Each round clones both commits afresh (``git clone`` of this repository, then ``git checkout``) and runs
``make setup .venv-frameworks/.installed .venv-crewai/.installed`` in each clone, sides alternated, with the
machine's warm pip and uv caches (what the issue's "warm pip cache" figure assumes). Wall time, and the CPU time
of make and everything it waited for (``getrusage(RUSAGE_CHILDREN)``). It also counts, per venv, the ``.py``
files and the ``.pyc`` files setup left: what a venv's first processes do not have to compile.

    PYTHONPATH=. .venv/bin/python bench/venv_setup.py --baseline be06f1c --rounds 2

Writes bench/results/venv_setup.md and bench/results/venv_setup.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, cpu, median_range

TARGETS = ["setup", ".venv-frameworks/.installed", ".venv-crewai/.installed"]
VENVS = [".venv", ".venv-frameworks", ".venv-crewai"]


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def files(venv: Path) -> dict[str, int]:
    site = next(venv.glob("lib/python3*/site-packages"))
    return {"py": sum(1 for _ in site.rglob("*.py")), "pyc": sum(1 for _ in site.rglob("*.pyc"))}


def set_up(commit: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="agl-setup-") as work:
        clone = Path(work) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        before, start = children_cpu(), time.perf_counter()
        done = subprocess.run(["make", *TARGETS], cwd=clone, capture_output=True, text=True)
        wall, used = time.perf_counter() - start, children_cpu() - before
        if done.returncode != 0:
            sys.exit(f"{commit}: make exited {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return {"wall": wall, "cpu": used, "files": {venv: files(clone / venv) for venv in VENVS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare with (e.g. be06f1c)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    sides = {"this checkout": head.stdout.strip(), "baseline": args.baseline}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in sorted(sides, reverse=r % 2 == 1):  # each side first every other round
            runs[side].append(set_up(sides[side]))
            print(side, {k: v for k, v in runs[side][-1].items() if k != "files"}, flush=True)

    def cell(side: str, key: str) -> str:
        return median_range([run[key] for run in runs[side]])

    def counts(side: str) -> str:
        last = runs[side][-1]["files"]
        return ", ".join(f"{venv} {last[venv]['pyc']:,} of {last[venv]['py']:,}" for venv in VENVS)

    lines = [
        "# `make test`'s setup from a fresh clone",
        "",
        f"`PYTHONPATH=. .venv/bin/python bench/venv_setup.py --baseline {args.baseline} --rounds {args.rounds}`: "
        f"`make {' '.join(TARGETS)}` in a fresh clone of each commit, warm pip/uv caches, sides alternated; "
        f"seconds, median [min, max]. CPU: {cpu()}.",
        "",
        "| | commit | wall | CPU | `.pyc` files setup left, of the `.py` files |",
        "|---|---|---:|---:|---|",
        *(
            f"| {side} | {sides[side]} | {cell(side, 'wall')} | {cell(side, 'cpu')} | {counts(side)} |"
            for side in sides
        ),
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "venv_setup.md").write_text(text)
    (RESULTS / "venv_setup.json").write_text(json.dumps({"sides": sides, "runs": runs}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
