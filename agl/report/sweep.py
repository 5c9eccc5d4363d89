"""Sweeps: deterministic multirun dirs, job status files, and the end-of-sweep summary.

``python harness.py -m task=gsm8k algo=grpo algo.lr=1e-5,3e-5 task.prompt=cot,steps`` runs every
combination (Hydra multirun) under ``outputs/multirun/<task>_<algo>_<hash>/<job overrides>/``:

* the sweep dir is keyed by a hash of the sorted command-line overrides (``sweep_id``), and
  each job dir by its own overrides (``job_dir_name``: ``algo.lr-1e-05+task.prompt-cot``), so the
  same command finds the same dirs again: finished jobs are skipped, unfinished or failed ones
  resume from their stores (``agl.jobs.dispatch.run_job`` reads ``status.json``);
* ``status.json`` in each job dir says ``running`` / ``succeeded`` / ``failed`` (with the
  error; the traceback is in ``error.log``); a failed job does not stop the sweep;
* at the end, ``SweepSummary`` (a Hydra callback, ``hydra.callbacks`` in conf/config.yaml)
  writes ``summary.md``, ``summary.csv`` and ``curves.png`` (every job's reward and eval
  curves overlaid) to the sweep dir. ``python harness.py report=<sweep dir>`` does the same
  later, from the files alone.

Nothing here imports torch: summaries and reports load no model."""

from __future__ import annotations

import atexit
import csv
import hashlib
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.report.plots import draw_panels, read_metrics
from agl.report.status import STATUS_FILE, effective_status, read_status
from agl.report.tables import RL, fmt, is_derived, markdown_table, vs_base, with_interval

if TYPE_CHECKING:
    from omegaconf import DictConfig

EXCLUDED_KEYS = ("resume", "report", "device", "progress", "threads", "logger")  # do not change what a job computes
SWEEP_PANELS = [("reward", ["reward_mean"]), ("eval", ["eval/reward"])]
IGNORED_EVAL = {"eval/n", "eval/failed", "eval/completion_tokens"}


# ----------------------------------------------------------------------------- dir names


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _safe(text: str) -> str:
    """Keep characters that are safe in a path and in a Hydra override value (no '=', ',', ':')."""
    return re.sub(r"[^\w.+@%-]+", "_", text).strip("_")


def command_overrides(argv: Sequence[str] | None = None) -> list[str]:
    """The config overrides on the command line, sorted; Hydra's own and the excluded keys left out."""
    argv = sys.argv[1:] if argv is None else argv
    return sorted(
        a
        for a in argv
        if "=" in a
        and not a.startswith("-")
        and not _key(a).startswith(("hydra.", "hydra/"))
        and _key(a) not in EXCLUDED_KEYS
    )


def sweep_id(argv: Sequence[str] | None = None) -> str:
    """``<task>_<algo>_<hash of the sorted overrides>``: the same command gives the same sweep dir."""
    overrides = command_overrides(argv)
    digest = hashlib.sha1("\n".join(overrides).encode()).hexdigest()[:8]
    names = [o.split("=", 1)[1].replace(",", "+") for key in ("task", "algo") for o in overrides if _key(o) == key]
    return "_".join([_safe(n)[:40] for n in names] + [digest])


def job_dir_name(override_dirname: str) -> str:
    """A job's subdir: its overrides, Hydra's override_dirname (``key-value+key-value``, see
    conf/config.yaml), made path-safe. No '=' or ',' in it, so ``report=<job dir>`` and
    ``resume=<job dir>`` need no quoting."""
    name = _safe(override_dirname.replace("/", "_")) or "defaults"
    if len(name) > 200:  # file names stop at 255 bytes
        name = name[:180] + "-" + hashlib.sha1(override_dirname.encode()).hexdigest()[:8]
    return name


# ----------------------------------------------------------------------------- the summary


def is_sweep_dir(path: Path) -> bool:
    path = Path(path)
    return (path / "multirun.yaml").is_file() or (not (path / "store.sqlite").exists() and bool(job_dirs(path)))


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job dirs directly under the sweep dir: those holding a status.json or a .hydra/ config."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        return []
    return sorted(
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and ((p / STATUS_FILE).is_file() or (p / ".hydra" / "overrides.yaml").is_file())
    )


def _overrides(job_dir: Path) -> dict[str, str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    from omegaconf import OmegaConf

    unescape = lambda value: re.sub(r"\\(.)", r"\1", value)  # noqa: E731  Hydra writes swept values escaped ("a\:b")
    return {
        _key(o): unescape(o.split("=", 1)[1]) if "=" in o else ""
        for o in OmegaConf.load(path)
        if _key(o) not in EXCLUDED_KEYS
    }


def _best(rows: Sequence[dict], key: str) -> tuple[float | None, int | None]:
    points = [(r[key], r["step"]) for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    if not points:
        return None, None
    value, step = max(points, key=lambda p: (p[0], -p[1]))
    return value, step


def _final(rows: Sequence[dict], key: str) -> Any:
    values = [r[key] for r in rows if r.get(key) is not None]
    return values[-1] if values else None


def job_record(job_dir: Path) -> dict:
    """One row of the summary: a job's status, overrides, and final and best metrics."""
    job_dir = Path(job_dir)
    status = read_status(job_dir) or {}
    rows = read_metrics(job_dir / "metrics.jsonl")
    metrics: dict[str, Any] = {}
    if rows:
        steps = [r["step"] for r in rows if r.get("step", -1) >= 0]
        metrics["steps"] = max(steps) + 1 if steps else 0
        metrics["final reward"] = _final(rows, "reward_mean")
        metrics["best reward"], _ = _best(rows, "reward_mean")
        metrics["final loss"] = _final(rows, "loss") if metrics["final reward"] is None else None
        for key in sorted(
            {k for r in rows for k in r if k.startswith(("eval/", "eval_all/")) and not is_derived(r, k)} - IGNORED_EVAL
        ):
            last = next(r for r in reversed(rows) if r.get(key) is not None)
            metrics[f"final {key}"] = with_interval(last, key)
            if (change := vs_base(last, key)) is not None:
                metrics[f"{key} vs base"] = change
            if (change := vs_base(last, key, since=RL)) is not None:  # GRPO's own, after a warm-up
                metrics[f"{key} RL"] = change
        best_eval, best_step = _best(rows, "eval/reward")
        metrics["best eval/reward"], metrics["best step"] = best_eval, best_step
    result = status.get("result")
    result = result if isinstance(result, dict) else {}  # algo=custom may return anything
    for key, value in (result.get("metrics") or {}).items():  # eval / prompt_search / custom results
        if key.startswith("eval/") and key not in IGNORED_EVAL:
            metrics.setdefault(f"final {key}", value)
        elif not key.startswith("eval/"):
            metrics.setdefault(key, value)
    return {
        "job": job_dir.name,
        "status": effective_status(status)
        if status
        else ("unfinished" if (job_dir / "store.sqlite").exists() else "unknown"),
        "algo": status.get("algo"),
        "overrides": _overrides(job_dir),
        "metrics": {k: v for k, v in metrics.items() if v is not None},
        "time_s": status.get("duration_s"),
        "error": status.get("error"),
        "rows": rows,
    }


def write_sweep_summary(sweep_dir: Path, echo: bool = True) -> dict:
    """Write ``summary.md``, ``summary.csv`` and ``curves.png`` to the sweep dir; return the records."""
    sweep_dir = Path(sweep_dir)
    records = [job_record(d) for d in job_dirs(sweep_dir)]
    keys = sorted({k for r in records for k in r["overrides"]})
    varying = [k for k in keys if len({r["overrides"].get(k) for r in records}) > 1]
    common = {k: records[0]["overrides"].get(k) for k in keys if k not in varying} if records else {}
    metric_names: list[str] = []
    for r in records:
        metric_names += [m for m in r["metrics"] if m not in metric_names]

    headers = ["job", "status", *varying, *metric_names, "time_s", "error"]
    md_rows = [
        [
            i,
            r["status"],
            *[r["overrides"].get(k, "") for k in varying],
            *[r["metrics"].get(m) for m in metric_names],
            r["time_s"],
            _short(r["error"]),
        ]
        for i, r in enumerate(records)
    ]
    counts = {s: sum(r["status"] == s for r in records) for s in sorted({r["status"] for r in records})}
    text = (
        f"# sweep: {sweep_dir}\n\n{len(records)} jobs: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + "\n\n"
        + ("common overrides: " + " ".join(f"{k}={v}" for k, v in common.items()) + "\n\n" if common else "")
        + markdown_table(headers, md_rows)
        + "\n\njobs:\n"
        + "".join(f"  {i}: {r['job']}\n" for i, r in enumerate(records))
    )
    (sweep_dir / "summary.md").write_text(text)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["job", "status", *keys, *metric_names, "time_s", "error"])
        for r in records:
            writer.writerow(
                [
                    r["job"],
                    r["status"],
                    *[r["overrides"].get(k, "") for k in keys],
                    *[fmt(r["metrics"].get(m)) for m in metric_names],
                    fmt(r["time_s"]),
                    r["error"] or "",
                ]
            )
    runs = {_label(r, varying, i): r["rows"] for i, r in enumerate(records) if r["rows"]}
    plot = draw_panels(runs, sweep_dir / "curves.png", SWEEP_PANELS) if runs else None
    if echo:
        print(text)
        print(
            f"written: {sweep_dir / 'summary.md'}, {sweep_dir / 'summary.csv'}"
            + (f", {plot}" if plot and plot.exists() else "")
        )
    return {"sweep_dir": str(sweep_dir), "jobs": [{k: v for k, v in r.items() if k != "rows"} for r in records]}


def _label(record: dict, varying: Sequence[str], index: int) -> str:
    parts = [f"{k.rsplit('.', 1)[-1]}={record['overrides'].get(k, '')}" for k in varying]
    return f"{index}: " + (" ".join(parts) if parts else record["job"])


def _short(error: str | None, limit: int = 120) -> str:
    if not error:
        return ""
    line = error.strip().splitlines()[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ----------------------------------------------------------------------------- the Hydra callback

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency
    Callback = object  # type: ignore[misc,assignment]


class SweepSummary(Callback):
    """Writes the sweep summary once every job of a multirun has returned.

    A launcher that gives up before that (a job's process killed, e.g. out of memory: joblib's and
    submitit's launchers then raise, and Hydra skips ``on_multirun_end``) still gets a summary, of
    what the job dirs say when the launching process exits; the same command resumes the rest."""

    def __init__(self) -> None:
        self._unfinished: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._unfinished = Path(str(config.hydra.sweep.dir))
        atexit.register(self._after_abort)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._unfinished = None
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            write_sweep_summary(sweep_dir)

    def _after_abort(self) -> None:
        if self._unfinished is not None and self._unfinished.is_dir():
            print(
                "the launcher stopped before every job was back; the summary says what the job dirs say now "
                "(run the same command again to resume):",
                file=sys.stderr,
            )
            write_sweep_summary(self._unfinished)
