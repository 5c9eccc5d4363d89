"""The route's schema-driven fuzz, long: ``tests/test_route_fuzz.py`` with many more examples per endpoint.

    PYTHONPATH=. python bench/fuzz_route.py --examples 2000

Runs the suite's fuzz tests (the same checks: no 5xx, documented statuses and content types, answers
and stream events that conform to the OpenAPI document, recorded spans that hold what was returned)
with ``AGL_FUZZ_EXAMPLES=<n>`` per endpoint, and writes what hypothesis counted (examples, statuses,
streamed, spans checked) and the outcome to bench/results/fuzz_route.{json,md}. A failure is reported
with hypothesis' shrunk example, as pytest prints it (the tail of its output goes into the results).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from common import RESULTS, ROOT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples per endpoint")
    parser.add_argument("-k", default="fuzzed", help="pytest -k: which fuzz tests (default: all four endpoints)")
    args = parser.parse_args()
    env = {**os.environ, "AGL_FUZZ_EXAMPLES": str(args.examples)}
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_route_fuzz.py", "-k", args.k]
        + ["--hypothesis-show-statistics"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.time() - started
    out = result.stdout + result.stderr
    tests: dict[str, dict] = {}
    current = None
    for line in out.splitlines():
        if m := re.match(r"tests/test_route_fuzz\.py::(\w+):", line):
            current = tests.setdefault(m.group(1), {"events": {}})
        elif current is not None and (m := re.match(r"\s+- (\d+) passing, (\d+) failing, and (\d+) invalid", line)):
            current.update(passing=int(m.group(1)), failing=int(m.group(2)), invalid=int(m.group(3)))
        elif current is not None and (m := re.match(r"\s+\* ([\d.]+)%, (.+)", line)):
            if not m.group(2).startswith(("Retried", "Draw for", "gave up")):
                current["events"][m.group(2)] = float(m.group(1))
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    record = {
        "command": f"PYTHONPATH=. python bench/fuzz_route.py --examples {args.examples} -k {args.k}",
        "examples_per_endpoint": args.examples,
        "passed": result.returncode == 0,
        "pytest": summary,
        "seconds": round(seconds, 1),
        "tests": tests,
        **({} if result.returncode == 0 else {"output_tail": out[-6000:]}),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fuzz_route.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# The route fuzzed from its OpenAPI document",
        "",
        f"`{record['command']}`: {summary} in {seconds:.0f} s.",
        "",
        "| test | examples | failing | what came back (% of examples) |",
        "| --- | --- | --- | --- |",
    ]
    for name, test in tests.items():
        events = ", ".join(f"{k} {v:.0f}" for k, v in sorted(test["events"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {name} | {test.get('passing', 0)} | {test.get('failing', 0)} | {events} |")
    if result.returncode != 0:
        lines += ["", "```", out[-6000:], "```"]
    (RESULTS / "fuzz_route.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
