"""Where the test suite's CPU time goes: each test's CPU seconds, with those of every process it started.

The `.venv` lane is bound by the CPU (on the 2-core AVX2 machine, and in its projection by bench/avx2_like.sh), so
its wall time is, at best, its CPU time over the cores: what to cut is what costs CPU, not what takes long. The
suite runs here in one process (``-n 0``: a test's time is then its own), in a cgroup-v1 ``cpuacct`` group of its
own, so that a test's figure holds the harnesses, runner processes, launcher jobs and forkservers it started, not
only the pytest process's own time. The cgroup's total also holds collection and the session's start and end.

    PYTHONPATH=. .venv/bin/python bench/suite_cpu.py                          (the suite `make test-main` runs)
    PYTHONPATH=. .venv/bin/python bench/suite_cpu.py -- tests/test_model.py   (a part of it)

Needs root and a writable cgroup-v1 cpuacct controller (/sys/fs/cgroup/cpuacct), as bench/avx2_like.sh does.
Writes bench/results/suite_cpu.md and bench/results/suite_cpu.json. As a pytest plugin (``-p suite_cpu``, which
this script passes) it appends one JSON line per test to ``$AGL_SUITE_CPU_LOG``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup/cpuacct")


def makefile_variable(root: Path, name: str) -> str:
    """The value of a ``NAME := value`` line of the Makefile (the one home of, say, the frameworks a lane needs)."""
    for line in (root / "Makefile").read_text().splitlines():
        if line.startswith(f"{name} :="):
            return line.split(":=", 1)[1].strip()
    raise KeyError(f"no `{name} :=` line in {root / 'Makefile'}")


def usage_s(group: Path) -> float:
    """The CPU seconds every process in ``group`` has used, the ones gone included."""
    return int((group / "cpuacct.usage").read_text()) / 1e9


# ----------------------------------------------------------------------------- the pytest plugin

if os.environ.get("AGL_SUITE_CPU_LOG"):
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """A test's setup, call and teardown: the group's CPU seconds and the wall time, to the log."""
        group = Path(os.environ["AGL_SUITE_CPU_CGROUP"])
        cpu, wall = usage_s(group), time.perf_counter()
        yield
        row = {"test": item.nodeid, "cpu_s": usage_s(group) - cpu, "wall_s": time.perf_counter() - wall}
        with open(os.environ["AGL_SUITE_CPU_LOG"], "a") as log:
            log.write(json.dumps(row) + "\n")


# ----------------------------------------------------------------------------- the script


def run_suite(pytest_args: list[str]) -> tuple[list[dict], float, float, int]:
    """The suite in one process inside a cgroup of its own: its rows, the group's CPU seconds, wall seconds, and
    pytest's exit status."""
    from common import ROOT

    group = CGROUPS / f"agl-suite-cpu.{os.getpid()}"
    group.mkdir()
    with tempfile.NamedTemporaryFile(prefix="agl-suite-cpu-", suffix=".jsonl") as log:
        bench = str(ROOT / "bench")
        env = {
            **os.environ,
            "AGL_SUITE_CPU_LOG": log.name,
            "AGL_SUITE_CPU_CGROUP": str(group),
            "PYTHONPATH": os.pathsep.join(filter(None, [bench, os.environ.get("PYTHONPATH")])),
        }
        env.setdefault("AGL_REQUIRE_FRAMEWORKS", makefile_variable(ROOT, "FRAMEWORKS_OPENAI3"))  # as make test-main
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-p", "suite_cpu"]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [*command, *pytest_args],
                cwd=ROOT,
                env=env,
                # in the group before pytest's first instruction, so that all it starts is counted
                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
            )
            wall, total = time.perf_counter() - start, usage_s(group)
        finally:
            for _ in range(100):  # a process a test left behind (a forkserver, a runner) may take a moment to end
                try:
                    group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                print(f"suite_cpu.py: {group} is left (a process still runs in it)", file=sys.stderr)
        rows = [json.loads(line) for line in Path(log.name).read_text().splitlines()]
    return rows, total, wall, done.returncode


def report(rows: list[dict], total: float, wall: float, status: int, command: str, top: int) -> str:
    from common import cpu

    in_tests = sum(r["cpu_s"] for r in rows)
    by_file: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_file[row["test"].split("::")[0]].append(row)
    file_cpu = {name: sum(r["cpu_s"] for r in rs) for name, rs in by_file.items()}
    costly_cpu = sum(r["cpu_s"] for r in rows if r["cpu_s"] >= 5.0)
    costly = sum(1 for r in rows if r["cpu_s"] >= 5.0)
    lines = [
        "# Where the suite's CPU time goes",
        "",
        f"`{command}`: the suite in one process (`-n 0`) inside a cgroup of its own; each test's CPU seconds hold "
        f"what every process it started used. CPU: {cpu()}.",
        "",
        f"- **{total:.0f} CPU s** in all over {wall:.0f} s of wall time (pytest exit status {status}), "
        f"{len(rows)} tests; {in_tests:.0f} s inside tests (setup, call and teardown), "
        f"{total - in_tests:.0f} s outside them (start, collection, the end).",
        f"- The {costly} tests of 5 CPU s or more: {costly_cpu:.0f} s ({costly_cpu / total:.0%}).",
        "",
        f"## The {top} costliest tests",
        "",
        "| CPU s | wall s | test |",
        "|---:|---:|---|",
        *(
            f"| {r['cpu_s']:.1f} | {r['wall_s']:.1f} | `{r['test']}` |"
            for r in sorted(rows, key=lambda r: -r["cpu_s"])[:top]
        ),
        "",
        "## By file",
        "",
        "| CPU s | share | tests | file |",
        "|---:|---:|---:|---|",
        *(
            f"| {file_cpu[name]:.1f} | {file_cpu[name] / total:.1%} | {len(by_file[name])} | `{name}` |"
            for name in sorted(file_cpu, key=lambda name: -file_cpu[name])
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    from common import RESULTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="how many tests the costliest table lists")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: the whole suite)")
    args = parser.parse_args()
    if not os.access(CGROUPS, os.W_OK):
        sys.exit(f"suite_cpu.py: needs root and a writable cgroup-v1 cpuacct controller ({CGROUPS})")
    rows, total, wall, status = run_suite(args.pytest_args)
    command = "PYTHONPATH=. .venv/bin/python bench/suite_cpu.py"
    if args.pytest_args:
        command += " -- " + " ".join(args.pytest_args)
    text = report(rows, total, wall, status, command, args.top)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "suite_cpu.md").write_text(text)
    summary = {"total_cpu_s": total, "wall_s": wall, "status": status, "args": args.pytest_args}
    (RESULTS / "suite_cpu.json").write_text(json.dumps({**summary, "tests": rows}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
