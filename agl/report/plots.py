"""Training curves as PNGs, redrawn from metrics.jsonl (no model, no store needed)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

PANELS = [
    ("reward", ["reward_mean"]),
    ("informative groups (unequal rewards), share of those drawn", ["informative_share"]),
    ("eval", ["eval/reward", "eval/correct", "eval/format", "eval/says_identity"]),
    ("loss", ["loss", "sft_loss"]),  # sft_loss: a GRPO job's SFT warm-up steps
    ("kl_entropy", ["kl", "entropy"]),
    ("length", ["completion_len_mean"]),
    ("clip", ["clip_ratio_low", "clip_ratio_high"]),
    ("time", ["time_rollout_s", "time_update_s", "time_other_s"]),
    ("peak RSS (MiB)", ["peak_rss_mib"]),
]
PANEL_IN = 2.6  # a panel's height, inches
TOP_IN, BOTTOM_IN, GAP_IN = 0.35, 0.5, 0.75  # room for the first title, the last x label, a label and a title


def read_metrics(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(rows: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
    return [p[0] for p in points], [p[1] for p in points]


def draw_panels(runs: dict[str, Sequence[dict]], out: Path, panels: Iterable[tuple[str, list[str]]] = PANELS) -> Path:
    """One figure, one panel per metric group, one line per (run, metric)."""
    panels = [
        (title, keys) for title, keys in panels if any(_series(rows, k)[0] for rows in runs.values() for k in keys)
    ]
    if not panels:
        return out
    # matplotlib's object API, imported here: no pyplot state, no backend to choose (PNG files only), and
    # a process that draws nothing (a runner process) does not load matplotlib
    from matplotlib.figure import Figure

    height = PANEL_IN * len(panels)
    fig = Figure(figsize=(8, height))
    # Margins fixed in inches: tight_layout measured them by drawing the figure once more, which doubled its cost
    # (this drawing is most of what a short job does after its last step)
    axes_in = (height - TOP_IN - BOTTOM_IN - GAP_IN * (len(panels) - 1)) / len(panels)
    fig.subplots_adjust(
        left=0.1, right=0.98, top=1 - TOP_IN / height, bottom=BOTTOM_IN / height, hspace=GAP_IN / axes_in
    )
    axes = fig.subplots(len(panels), 1, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for run, rows in runs.items():
            for key in keys:
                x, y = _series(rows, key)
                if x:
                    label = key if len(runs) == 1 else f"{run}: {key}"
                    ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(out, dpi=90)
    return out


def draw_run_plots(metrics_path: Path, run_dir: Path) -> Path:
    return draw_panels({"run": read_metrics(metrics_path)}, Path(run_dir) / "curves.png")
