"""Hydra's launcher plugins, as agl uses them: how many threads a job takes, and a launcher name checked.

Sweeps (``-m``) run on any Hydra launcher: the basic one (jobs one after another, in this process),
``hydra/launcher=joblib`` (worker processes on this machine), ``submitit_local`` (one process per
job, all at once), ``submitit_slurm`` (one SLURM job each) or ``ray``. agl's part is the same on all
of them (``agl.jobs.dispatch.run_job``: status files, skip or resume; ``agl.report.sweep.SweepSummary``: the summary
once all jobs are back); what differs is how many jobs share this machine's cores.

``threads`` (conf/config.yaml) sets torch's intra-op threads and ``OMP_NUM_THREADS`` /
``MKL_NUM_THREADS`` / ``OPENBLAS_NUM_THREADS`` for the job's child processes (runner processes).
``null`` (auto) is the cores this process may use (its CPU affinity: SLURM's allocation on a
cluster) divided by the jobs the launcher runs at once on them:

  basic launcher, or no sweep       1 job at once
  joblib                            n_jobs (joblib's reading: -1 = every core), at most the jobs of the sweep
  submitit_local                    every job of the sweep (its local executor starts them all)
  submitit_slurm, ray               1: each job has an allocation of its own; its ``cpus_per_task`` /
                                    ``ray.remote.num_cpus`` caps the count
  any other launcher                every job of the sweep, as for submitit_local (the safe guess)

and an ``OMP_NUM_THREADS`` set before agl started (by the user, or by Ray for its workers) caps it.
"The jobs of the sweep" are those of one batch of Hydra's basic sweeper, counted from the sweep's
``multirun.yaml``; with another sweeper they are unknown, and every core counts as a job.

Left out: torch's inter-op pool (``set_num_interop_threads`` may be called only before any parallel
work; agl's forward passes are intra-op), and jobs run as threads of one process (joblib's
``prefer=threads``): they would share the process's one compute thread (agl.policy.compute_thread), one job's
model work at a time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from agl.errors import ConfigError
from agl.memory import active_allocator

log = logging.getLogger(__name__)

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# read once, at import: after a job has set it for its children, it is no longer the user's
USER_OMP_THREADS = os.environ.get("OMP_NUM_THREADS")

BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
SUBMITIT_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
OWN_ALLOCATION = (  # a job of these runs where the scheduler put it, on cores of its own
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
    "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher",
    "hydra_plugins.hydra_ray_launcher.ray_aws_launcher.RayAWSLauncher",
)
# launcher names (hydra/launcher=...) and the pip extra that brings them
LAUNCHER_EXTRAS = {
    "joblib": "pip install -e '.[launchers]'",
    "submitit_local": "pip install -e '.[launchers]'",
    "submitit_slurm": "pip install -e '.[launchers]'",
    "ray": "pip install hydra-ray-launcher",
    "ray_aws": "pip install hydra-ray-launcher",
}


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a SLURM allocation's, under SLURM)."""
    return len(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------- threads


def sweep_batch_size(hydra_cfg: DictConfig) -> int | None:
    """Jobs in the largest batch of this sweep (Hydra's basic sweeper), from ``multirun.yaml``; None if unknown."""
    if OmegaConf.select(hydra_cfg, "sweeper._target_") != BASIC_SWEEPER:
        return None
    path = Path(str(hydra_cfg.sweep.dir)) / "multirun.yaml"  # the sweeper writes it before launching
    if not path.is_file():
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    master = OmegaConf.load(path).hydra
    params = master.sweeper.get("params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(master.overrides.task)
    try:  # as BasicSweeper.sweep splits them
        batches = BasicSweeper.split_arguments(
            OverridesParser.create().parse_overrides(arguments), master.sweeper.get("max_batch_size")
        )
    except HydraException:  # glob(...) choices need Hydra's config loader: the count stays unknown
        return None
    return max((len(b) for b in batches), default=None)


def jobs_at_once(hydra_cfg: DictConfig, cores: int, batch: int | None) -> tuple[int, str]:
    """How many jobs the launcher runs at once on this process's cores, and why."""
    launcher = hydra_cfg.launcher
    target = launcher.get("_target_")
    if target == BASIC:
        return 1, "basic launcher: one job at a time"
    if target in OWN_ALLOCATION:
        return 1, f"{target.rsplit('.', 1)[-1]}: each job on an allocation of its own"
    if target == JOBLIB:
        n = launcher.get("n_jobs")
        n_jobs = (
            n if n and n > 0 else max(1, cores + 1 + n) if n else 1
        )  # joblib's reading: -1 every core, -2 all but one
        return (min(n_jobs, batch) if batch else n_jobs), f"joblib n_jobs={launcher.get('n_jobs')}" + (
            f", {batch} jobs" if batch else ""
        )
    name = "submitit_local" if target == SUBMITIT_LOCAL else f"launcher {target}"
    return (batch or cores), f"{name}: " + (f"{batch} jobs at once" if batch else "jobs at once unknown, one core each")


def auto_threads(
    hydra_cfg: DictConfig | None, cores: int, user_omp: str | None = None, batch: int | None = None
) -> tuple[int, str]:
    """``threads: null``: (threads per job, why). ``hydra_cfg`` is a multirun job's Hydra config, else None."""
    at_once, why = (1, "one job") if hydra_cfg is None else jobs_at_once(hydra_cfg, cores, batch)
    threads = max(1, cores // max(1, at_once))
    why = f"{cores} cores / {at_once} ({why})"
    caps = {}
    if hydra_cfg is not None:
        caps["hydra.launcher.cpus_per_task"] = OmegaConf.select(hydra_cfg, "launcher.cpus_per_task")
        caps["hydra.launcher.ray.remote.num_cpus"] = OmegaConf.select(hydra_cfg, "launcher.ray.remote.num_cpus")
    caps["OMP_NUM_THREADS"] = user_omp
    for name, value in caps.items():
        if value is not None and str(value).strip().isdigit() and 0 < int(value) < threads:
            threads, why = int(value), f"{why}, capped by {name}={value}"
    return threads, why


def thread_count(cfg: DictConfig, hydra_cfg: DictConfig | None) -> tuple[int, str]:
    """The ``threads`` setting made a number (see the module docstring); ConfigError for a bad one."""
    setting = cfg.get("threads")
    if setting is None:
        batch = sweep_batch_size(hydra_cfg) if hydra_cfg is not None else None
        return auto_threads(hydra_cfg, usable_cores(), USER_OMP_THREADS, batch)
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ConfigError(f"threads={setting!r}: expected a whole number of threads per job (>= 1), or null for auto")
    return setting, "threads setting"


def apply_threads(cfg: DictConfig, hydra_cfg: DictConfig | None, loads_torch: bool = True) -> int:
    """Limit this job's torch threads, and its child processes' OpenMP/BLAS threads; the count.

    ``loads_torch=False`` (a runner process: agents and HTTP calls) leaves torch unimported, which would cost
    it seconds and hundreds of MiB: the variables are set, and a torch an agent imports later reads its count
    from them (without what ``set_num_threads`` also does: MKL's dynamic mode off, torch's own pools sized)."""
    threads, why = thread_count(cfg, hydra_cfg)
    for name in THREAD_ENV:  # for runner processes and anything else this job starts
        os.environ[name] = str(threads)
    if loads_torch:
        import torch

        from agl.policy import compute_thread

        torch.set_num_threads(threads)
        compute_thread.set_threads(threads)  # per thread in torch: the model's work runs on that one
    log.info("torch threads: %d (%s); malloc: %s", threads, why, active_allocator())
    return threads


# ----------------------------------------------------------------------------- launcher names


def launcher_choice(argv: Sequence[str]) -> str | None:
    """The ``hydra/launcher=NAME`` on a command line, if any."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "hydra/launcher":
            return value
    return None


def launcher_names(conf_dir: Path) -> list[str]:
    """The launchers Hydra can compose here: its own ``basic`` and those of the installed plugins."""
    # Hydra's own listing (the one its "Could not find" error prints), from its config search path
    # with the plugins' entries; hydra-core>=1.3 (setup.cfg).
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    return ConfigLoaderImpl(config_search_path=create_config_search_path(str(conf_dir))).get_group_options(
        "hydra/launcher"
    )


def check_launcher(argv: Sequence[str], conf_dir: Path) -> None:
    """A ``hydra/launcher=`` that Hydra cannot find is a one-line ConfigError naming it (Hydra's own
    error is a dozen lines about config search paths)."""
    name = launcher_choice(argv)
    if name is None:
        return
    known = launcher_names(conf_dir)
    if name in known:
        return
    install = LAUNCHER_EXTRAS.get(name)
    raise ConfigError(
        f"hydra/launcher={name}: "
        + (f"that launcher's plugin is not installed ({install})" if install else "no such launcher")
        + f"; available here: {', '.join(known)}"
    )
