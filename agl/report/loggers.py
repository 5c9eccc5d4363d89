"""``logger=tensorboard`` / ``logger=wandb`` (or ``logger=[tensorboard,wandb]``): metrics.jsonl's rows,
also where researchers look.

Every line a trainer writes to ``metrics.jsonl`` (``agl.train.resume.append_metrics``: one per step,
after its checkpoint committed, and the baseline eval as step -1) goes to each logger of the run,
keyed by its ``step``: the numbers in the row (``int``/``float``; text such as ``stage`` is left out)
as scalars named as in the file. Default: no logger beyond metrics.jsonl.

* ``tensorboard``: event files in the run dir (``tensorboard --logdir <run dir or sweep dir>``),
  written with torch's ``SummaryWriter``; needs ``pip install -e '.[tensorboard]'``.
* ``wandb``: a W&B run in ``<run dir>/wandb/`` named after the run dir, with the composed config,
  grouped by sweep dir in a sweep; ``WANDB_MODE=offline`` works without an account (``wandb sync``
  uploads later), and ``WANDB_PROJECT`` / ``WANDB_ENTITY`` choose where it goes (project ``agl``
  otherwise). The x axis is agl's ``step`` (``define_metric``), so the baseline at -1 is on it. Needs
  ``pip install -e '.[wandb]'``.

Resume. ``metrics.jsonl`` is rewritten from the store when a run resumes, and the loggers follow it:
the first row a process logs makes each logger catch up from the file first.
  * tensorboard writes everything again, opening its writer with ``purge_step`` at the file's first
    step: TensorBoard then hides every earlier event from that step on, so it shows the store's one
    curve even where a killed process had logged a step the store never committed.
  * wandb's history only grows: each row goes out as W&B step ``step + 1`` (W&B's start at 0), into
    the same W&B run (``resume="allow"``, its id kept in ``<run dir>/wandb/agl_run_id``). A resumed
    run sends the rows from the first step W&B does not hold yet (``run.step``): online, the server
    says which; offline, a new offline dir holds the whole run again (``wandb sync <run dir>/wandb/latest-run``),
    since a killed process's W&B service loses what it had not written yet.

Left out: jobs that write no metrics.jsonl (``algo=eval``, ``prompt_search``, ``custom``: their
results are in ``status.json``), and models, media or text in either logger.
"""

from __future__ import annotations

import abc
import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import ListConfig

from agl.errors import ConfigError
from agl.report.plots import read_metrics

WANDB_PROJECT = "agl"  # when WANDB_PROJECT is not set
_ACTIVE: dict[str, list[Logger]] = {}  # resolved run dir -> the loggers of the job running there


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers, by name; ``step`` is the x axis, not a curve."""
    return {
        k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class Logger(abc.ABC):
    """One backend for one run dir. Opened at the first row, from the whole metrics.jsonl."""

    def __init__(self, run_dir: Path, record: dict, group: str | None = None):
        """``record``: the run's config as plain data; ``group``: the sweep this run is a job of (its sweep
        dir's name), None for a single run."""
        self.run_dir, self.record, self.group, self.opened = Path(run_dir), record, group, False

    def log(self, row: dict) -> None:
        if not self.opened:
            self.opened = True
            self.open(read_metrics(self.run_dir / "metrics.jsonl") or [row])  # the file already has the row
        else:
            self.write([row])

    @abc.abstractmethod
    def open(self, rows: list[dict]) -> None: ...

    @abc.abstractmethod
    def write(self, rows: list[dict]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class TensorBoard(Logger):
    def __init__(self, run_dir: Path, record: dict, group: str | None = None):
        super().__init__(run_dir, record, group)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package
            raise ConfigError(
                "logger=tensorboard needs the tensorboard package: pip install -e '.[tensorboard]'"
            ) from None
        self._writer_class, self.writer = SummaryWriter, None

    def open(self, rows: list[dict]) -> None:
        # purge_step: TensorBoard drops the events of earlier processes from this step on
        self.writer = self._writer_class(log_dir=str(self.run_dir), purge_step=min(r["step"] for r in rows))
        self.write(rows)

    def write(self, rows: list[dict]) -> None:
        for row in rows:
            for name, value in scalars(row).items():
                self.writer.add_scalar(name, value, global_step=row["step"])
        self.writer.flush()  # one row per step: a killed job loses nothing it logged

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB(Logger):
    def __init__(self, run_dir: Path, record: dict, group: str | None = None):
        super().__init__(run_dir, record, group)
        try:
            import wandb
        except ImportError:
            raise ConfigError("logger=wandb needs the wandb package: pip install -e '.[wandb]'") from None
        self.wandb, self.run = wandb, None
        self.id_path = self.run_dir / "wandb" / "agl_run_id"  # the same W&B run when the job resumes

    def open(self, rows: list[dict]) -> None:
        run_id = self.id_path.read_text().strip() if self.id_path.is_file() else secrets.token_hex(4)  # a valid W&B id
        self.run = self.wandb.init(
            dir=str(self.run_dir),
            id=run_id,
            resume="allow",
            name=self.run_dir.name,
            project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
            group=self.group,
            config=self.record,
            settings=self.wandb.Settings(console="off"),  # agl's output stays agl's (harness.log has it)
        )
        self.id_path.write_text(run_id)  # wandb.init made the dir
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # charts over agl's step, the baseline at -1 included
        held = self.run.step  # W&B's next step: a resumed run (online) already holds the ones below it
        self.write([r for r in rows if r["step"] + 1 >= held])

    def write(self, rows: list[dict]) -> None:
        for row in rows:  # W&B's own step (from 0, only growing) is agl's + 1
            self.run.log({"step": row["step"], **scalars(row)}, step=row["step"] + 1, commit=True)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


LOGGERS: dict[str, type[Logger]] = {"tensorboard": TensorBoard, "wandb": WandB}


def logger_names(setting: Any) -> list[str]:
    """``logger``: null, a name, or a list of names; ConfigError naming an unknown one."""
    if setting is None:
        return []
    names = list(setting) if isinstance(setting, (list, tuple, ListConfig)) else [setting]
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(
                f"logger={name}: no such logger; known: {', '.join(LOGGERS)} (or null for metrics.jsonl only)"
            )
    return list(dict.fromkeys(names))


def _key(run_dir: Path) -> str:
    return str(Path(run_dir).resolve())


@contextlib.contextmanager
def run_loggers(setting: Any, record: dict, run_dir: Path, group: str | None = None) -> Iterator[list[Logger]]:
    """The job's loggers (``setting``: the config's ``logger``) for rows written to ``run_dir``'s metrics.jsonl
    while it runs; ``record`` is the run's config as plain data (W&B keeps it), ``group`` names the sweep (W&B
    groups its jobs by it). A missing package or an unknown name is a ConfigError now, before the model loads."""
    loggers = [LOGGERS[name](run_dir, record, group) for name in logger_names(setting)]
    if not loggers:
        yield loggers
        return
    _ACTIVE[_key(run_dir)] = loggers
    try:
        yield loggers
    finally:
        _ACTIVE.pop(_key(run_dir), None)
        for logger in loggers:
            logger.close()


def log_row(run_dir: Path, row: dict) -> None:
    """A row just appended to ``run_dir``'s metrics.jsonl, to the loggers of the job running there."""
    for logger in _ACTIVE.get(_key(run_dir), ()):
        logger.log(row)
