"""Dispatch a composed config to the job its `algo.name` names.

``run_job`` also owns what every job shares: ``report=`` (no model, dispatched first),
``resume=``, the run dir's lock (``agl.jobs.run_lock``: one live job per run dir; a second is
refused, or skipped in a sweep) and its ``status.json`` (running / succeeded / failed). A run dir
whose status is ``succeeded`` is skipped; any other existing run dir is resumed from its
store. In a sweep (Hydra multirun) a failing job is recorded as failed, its traceback
written to ``error.log``, and the sweep goes on.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from agl.config import ALGO_SCHEMAS, Config, check_exposure, check_server_exposure, config_record, to_typed, with_schema
from agl.config.renamed import rename_saved
from agl.errors import ConfigError, DiskFull, disk_full_in
from agl.jobs.launchers import apply_threads
from agl.jobs.run_lock import RunDirBusy, holding_run_dir
from agl.report.loggers import run_loggers
from agl.report.metrics import draw_curves
from agl.report.status import read_status, write_status
from agl.seeding import seed_everything

log = logging.getLogger(__name__)


NO_MODEL = ("runner", "store")  # jobs that load no model (and no torch): a runner process, a store server


def job_function(name: str) -> Callable[[Config, Path], object]:
    """The ``run(config, run_dir)`` of ``agl.jobs.<name>``: every algorithm with a schema (``ALGO_SCHEMAS``) has
    its job module of the same name. Imported when the job runs: report= and a launcher's checks load no torch."""
    return importlib.import_module(f"agl.jobs.{name}").run


def serves_store(name: str, config: Config) -> bool:
    """Whether the job serves its store over HTTP: ``algo=store``, or a job whose runner processes start
    where they reach it by URL only (``runner.launcher`` other than local) and that has no ``store.url``."""
    if name == "store":
        return True
    runner = config.runner
    return name not in NO_MODEL and not config.store.url and runner.processes > 0 and runner.launcher != "local"


def resumed_config(cfg: DictConfig) -> DictConfig:
    """The config a run was started with, read back from its run dir."""
    run_dir = Path(cfg.resume)
    saved = run_dir / ".hydra" / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume='{cfg.resume}' is not a run dir (no {saved})")
    # keys renamed since the run started are mapped; keys added since then take their defaults
    original = with_schema(rename_saved(OmegaConf.load(saved)))
    original.resume = str(run_dir)
    return original


QUIET_LOGGERS = ("httpx", "httpx2", "httpcore", "openai")


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def config_hash(cfg: DictConfig) -> str:
    plain = OmegaConf.to_container(cfg, resolve=True)
    # run_dir: agl.run's, where Hydra's is not in cfg; eval_cache: where results are kept, not what runs
    for key in ("resume", "report", "progress", "device", "run_dir", "threads", "logger", "eval_cache"):
        plain.pop(key, None)
    return hashlib.sha1(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_job(cfg: DictConfig) -> object:
    for name in QUIET_LOGGERS:  # one line per agent HTTP call would drown the progress bars
        logging.getLogger(name).setLevel(logging.WARNING)
    if cfg.get("report"):  # reads files only: no model, no status
        from agl.report.run_report import report

        return report(cfg.report)
    multirun = in_multirun()
    if cfg.get("resume"):
        cfg = resumed_config(cfg)
        run_dir = Path(cfg.resume)
    else:
        run_dir = (
            Path(HydraConfig.get().runtime.output_dir)
            if HydraConfig.initialized()
            else Path(cfg.get("run_dir") or cfg.get("attach") or ".")
        )
    name = cfg.algo.name
    if name not in ALGO_SCHEMAS:
        raise ConfigError(f"algo '{name}' has no job; known: {', '.join(sorted(ALGO_SCHEMAS))}")
    if cfg.get("attach") and name != "runner":
        raise ConfigError(f"attach= joins a running job as a runner process: use it with algo=runner, not algo={name}")
    # jobs x threads <= cores (agl/jobs/launchers.py)
    threads = apply_threads(cfg, HydraConfig.get() if multirun else None, loads_torch=name not in NO_MODEL)
    config = to_typed(cfg)  # the one conversion: below here, every part takes its typed section
    if name not in NO_MODEL:  # a device this machine lacks is refused before the job's modules and model load
        from agl.policy.device import resolve_device  # torch: not in a runner process, nor for report=

        resolve_device(config.device)
    if name not in ("info", "runner", "export", "store"):  # the jobs that serve the route: refused before loading
        check_server_exposure(config.server)
    if serves_store(name, config):
        store = config.store
        check_exposure("store", store.host, store.api_key, store.allow_public)
    # a smoke test; a process working in another job's run: nothing of their own to record or resume
    if name in ("info", "runner"):
        return job_function(name)(config, run_dir)
    if name == "store":  # one server per store file; it has no result to record, and serves again when asked
        try:
            with holding_run_dir(run_dir):
                return job_function(name)(config, run_dir)
        except RunDirBusy as busy:
            raise ConfigError(f"{busy}; its store is served (or trained) by that process") from None

    try:
        with holding_run_dir(run_dir):
            return _run_held(cfg, config, name, run_dir, multirun, threads)
    except RunDirBusy as busy:
        pid = busy.holder.get("pid", "unknown")
        if multirun:  # a sweep run twice at once: each job dir is trained by one of them
            print(f"skip: {run_dir} is held by a live job (pid {pid}); this sweep leaves it to that job")
            return None
        raise ConfigError(
            f"{busy}; it is not trained twice: wait for it or stop it (kill {pid}), "
            f"or join it as a runner process with algo=runner attach={run_dir}"
        ) from None


def _run_held(cfg: DictConfig, config: Config, name: str, run_dir: Path, multirun: bool, threads: int) -> object:
    """The job, with its run dir's lock held (``run_job``): status.json, the job itself, its end."""
    previous = read_status(run_dir)
    digest = config_hash(cfg)
    if previous and previous.get("config_hash") not in (None, digest):
        log.warning(
            "%s was started with a different config (changed conf/ files?); continuing with the new one", run_dir
        )
    if previous and previous.get("status") == "succeeded":
        print(
            f"skip: {run_dir} already finished (its {run_dir / 'status.json'} says succeeded; delete it to run again)"
        )
        return previous.get("result")
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    if previous:
        gone = (
            f"; its job, pid {previous.get('pid')}, is gone"
            if previous.get("status") == "running" and previous.get("pid") not in (None, os.getpid())
            else ""
        )
        print(f"continuing {run_dir} (status was {previous.get('status')}{gone}) from its store")
    started = time.time()
    write_status(
        run_dir,
        "running",
        algo=name,
        task=cfg.task.name,
        pid=os.getpid(),
        host=os.uname().nodename,
        started=started,
        ended=None,
        duration_s=None,
        error=None,
        config_hash=digest,
        threads=threads,
        **({"overrides": overrides} if overrides and not cfg.get("resume") else {}),
    )
    try:
        seed_everything(config.seed)  # before the model is built: the LoRA's initial weights repeat
        group = run_dir.parent.name if multirun else None  # W&B groups a sweep's jobs by their sweep dir
        # logger=: metrics.jsonl's rows also to tensorboard / wandb
        with run_loggers(config.logger, config_record(config), run_dir, group):
            result = job_function(name)(config, run_dir)
    except (Exception, SystemExit) as error:
        full = disk_full_in(error)
        if full is not None:  # one line, and no more writes than can fail: the run resumes from its store
            error = DiskFull(full.path, run_dir)
            with contextlib.suppress(OSError, DiskFull):
                write_status(run_dir, "failed", error=str(error), ended=time.time(), duration_s=time.time() - started)
            if not multirun:
                raise error from None
            log.error("job stopped, the sweep goes on: %s", error)
            return None
        draw_curves(run_dir)  # what a failed job had logged
        trace = traceback.format_exc()
        (run_dir / "error.log").write_text(trace)
        message = f"{type(error).__name__}: {error}"
        write_status(run_dir, "failed", error=message, ended=time.time(), duration_s=time.time() - started)
        if not multirun:
            raise
        log.error("job failed, the sweep goes on: %s (traceback in %s)", message, run_dir / "error.log")
        return None
    finally:
        if multirun:
            gc.collect()  # the next job loads its own policy
    write_status(run_dir, "succeeded", result=result, ended=time.time(), duration_s=time.time() - started)
    return result
