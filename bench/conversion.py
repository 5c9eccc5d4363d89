"""The embedded model's first conversion (GGUF -> safetensors, agl.policy.weights.convert_embedded), with and
without ``gguf_read_once``: what parsing the file once and building gguf-py's tensor-name map once save.

The first job after `make setup` converts the embedded GGUF into the model cache; so does every test session with
an empty ``AGL_CACHE`` (CI's), and tests/test_model.py once more into a cache of its own. "without" swaps the helper
for a no-op, as the converter ran before it. Each conversion runs in a process of its own (its imports done before
the clock starts), into an empty cache, the sides alternated; both must write the same files (their checksums).

    PYTHONPATH=. .venv/bin/python bench/conversion.py --rounds 3

Writes bench/results/conversion.md, and each round's times to bench/results/conversion.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

from common import RESULTS, ROOT, cpu, median_range

ONE = """
import contextlib, json, resource, sys, time
from pathlib import Path
import torch, transformers, gguf  # imported before the clock starts
from agl.policy import weights

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

if sys.argv[1] == "without":
    weights.gguf_read_once = contextlib.nullcontext
wall, used = time.perf_counter(), cpu()
target = weights.convert_embedded(Path(sys.argv[2]))
wall, used = time.perf_counter() - wall, cpu() - used
files = json.loads((target / weights.MANIFEST).read_text())["files"]
print(json.dumps({"wall": wall, "cpu": used, "files": files}))
"""


def convert(side: str) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        done = subprocess.run([sys.executable, "-c", ONE, side, cache], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{side}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    sides = ("with", "without")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sorted(sides, reverse=r % 2 == 1):  # each side first every other round
            runs[side].append(convert(side))
    manifests = {json.dumps(run["files"], sort_keys=True) for side in sides for run in runs[side]}
    assert len(manifests) == 1, "the two sides wrote different files"

    def cell(side: str, key: str) -> str:
        return median_range([run[key] for run in runs[side]])

    ratio = statistics.median(r["wall"] for r in runs["without"]) / statistics.median(r["wall"] for r in runs["with"])
    lines = [
        "# The embedded model's conversion, with and without gguf_read_once",
        "",
        f"`PYTHONPATH=. .venv/bin/python bench/conversion.py --rounds {rounds}`: a process per conversion, into an "
        f"empty cache, sides alternated; seconds, median [min, max]. Both sides wrote the same files. CPU: {cpu()}.",
        "",
        "| | wall | CPU |",
        "|---|---:|---:|",
        *(f"| {side} | {cell(side, 'wall')} | {cell(side, 'cpu')} |" for side in sides),
        "",
        f"without / with (wall): {ratio:.2f}x",
    ]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "conversion.md").write_text(text)
    raw = {side: [{k: run[k] for k in ("wall", "cpu")} for run in runs[side]] for side in sides}
    (RESULTS / "conversion.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
