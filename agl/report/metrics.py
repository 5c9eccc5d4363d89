"""``metrics.jsonl``: one JSON line per training step (the baseline eval as step -1), a readable copy of the
store's metrics. Trainers append a row after its step's checkpoint committed; a resumed run rewrites the
file from the store, so a line written for a step that never committed disappears. The curves
(``curves.png``) are drawn from it when a job ends, when it resumes, and on ``report=``, not per step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agl.errors import disk_full_named
from agl.memory import peak_rss_mib
from agl.report.loggers import log_row


def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / "metrics.jsonl"


def append_metrics(run_dir: Path, row: dict) -> None:
    """One line of metrics.jsonl, and the row to the run's loggers (``logger=``).
    Every row carries the process's peak RSS so far: where it jumps is the phase that set it."""
    row = {**_plain(row), "peak_rss_mib": round(peak_rss_mib(), 1)}
    with disk_full_named(metrics_path(run_dir)), open(metrics_path(run_dir), "a") as f:
        f.write(json.dumps(row) + "\n")
    log_row(run_dir, row)


def draw_curves(run_dir: Path) -> Path | None:
    """``curves.png`` from the run's metrics.jsonl (None when it has none): at a job's end, on resume, on report=."""
    if not metrics_path(run_dir).is_file():
        return None
    from agl.report.plots import draw_run_plots  # matplotlib: only when drawing

    with disk_full_named(Path(run_dir) / "curves.png"):
        return draw_run_plots(metrics_path(run_dir), run_dir)


def rewrite_metrics(run_dir: Path, rows: Iterable[dict]) -> None:
    """metrics.jsonl as exactly ``rows`` (a resumed run's, read back from the store)."""
    with disk_full_named(metrics_path(run_dir)):
        metrics_path(run_dir).write_text("".join(json.dumps(_plain(r)) + "\n" for r in rows))


def _plain(row: Any) -> Any:
    """The row with torch scalars as floats, JSON-ready (told by their type's module: no torch import here)."""
    return {k: (float(v) if type(v).__module__.startswith("torch") else v) for k, v in dict(row).items()}
