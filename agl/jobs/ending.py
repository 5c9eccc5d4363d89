"""What a training job prints when it ends: what it learned, where its files are, and how to go on.

The learning table is report.md's comparison with the base model (``agl.report.run_report.learning_table``):
each 0/1 score before and after, with Wilson intervals, the tasks gained and lost, and McNemar's exact p.
report.md and curves.png are written first, so the paths printed exist.
"""

from __future__ import annotations

from pathlib import Path

from agl.config import Config
from agl.report.metrics import metrics_path
from agl.report.plots import read_metrics
from agl.report.run_report import learning_table, report_run


def job_ending(run_dir: Path, config: Config, adapter: str) -> str:
    """The lines a GRPO or SFT job prints at its end (and writes report.md for)."""
    # status.json says so once the job has returned; the trainer drew curves.png as it returned. A store served
    # elsewhere (store.url) is read where its file is: report= runs there, on the store server's run dir.
    remote = config.store.url
    if not remote:
        report_run(run_dir, echo=False, status="succeeded", draw=False)
    table = learning_table(read_metrics(metrics_path(run_dir)))
    algo = config.algo.name
    more = "algo.warmup.steps=0 algo.steps=<n>" if algo == "grpo" else "algo.steps=<n>"
    report = (
        f"python harness.py report=<its run dir> where the store at {remote} keeps its file"
        if remote
        else run_dir / "report.md"
    )
    lines = [
        table or "(no learning table: the job ran no baseline and final eval of the same tasks)",
        "",
        f"report:  {report}",
        f"curves:  {run_dir / 'curves.png'}",
        f"run dir: {run_dir}",
        f"adapter: {adapter}",
        f"resume:  python harness.py resume={run_dir}    (a stopped or killed run goes on from its last step)",
        f"extend:  python harness.py task={config.task.name} algo={algo} model.adapter={run_dir} {more}"
        "    (a new run that starts from this adapter)",
    ]
    return "\n".join(lines)
