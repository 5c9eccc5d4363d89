"""agl's one entry point: `python harness.py task=gsm8k algo=grpo` (Hydra composes conf/).

Hydra owns config composition, overrides, sweeps (-m) and run dirs; agl.jobs.dispatch owns the work.
Resume a run in place with `python harness.py resume=<run dir>`; summarize one (or a sweep)
with `python harness.py report=<dir>`. Sweeps: `python harness.py -m algo.lr=1e-5,3e-5 ...`.
"""

import logging
import os
import sys

# OpenMP's wait policy is left to libgomp's default, a bounded spin: the model's work runs on one thread
# (agl/policy/compute_thread.py), whose one team of workers spins between a step's parallel regions.
from agl.errors import ConfigError  # noqa: E402
from agl.memory import cap_kernel_caches, preload_allocator, release_freed_memory, runs_on_cuda  # noqa: E402

# The CPU-only memory measures (agl/memory.py) stay off a run on a CUDA device; cuBLAS gets the workspace
# setting its deterministic mode needs, read once when it starts (agl/policy/device.py).
ON_CUDA = runs_on_cuda(sys.argv[1:])
if ON_CUDA:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
elif __name__ == "__main__":
    try:
        preload_allocator()  # tcmalloc, else the mimalloc wheel: this command again, under it (agl/memory.py)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
if not ON_CUDA:
    release_freed_memory()  # before torch allocates: freed tensors go back to the OS (agl/memory.py)
    cap_kernel_caches()  # before torch's first matmul: a bounded number of compiled kernels

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from agl.config import check_command_line, register_configs  # noqa: E402
from agl.config.choices import register_help_resolver  # noqa: E402
from agl.config.renamed import rename_overrides  # noqa: E402
from agl.jobs.launchers import check_launcher  # noqa: E402
from agl.report.sweep import job_dir_name, sweep_id  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))

# A resumed run writes into its own dir, and keeps the .hydra/ config it was started with;
# a report, and a runner process attached to a run, write no config at all.
OmegaConf.register_new_resolver(
    "agl_run_dir", lambda resume, report, attach, fresh: resume or report or attach or fresh
)
OmegaConf.register_new_resolver(
    "agl_output_subdir", lambda resume, report, attach: None if (resume or report or attach) else ".hydra"
)
# Sweeps: the same command line gives the same sweep dir (cached: every job sees the launcher's
# value) and the same job subdirs, so re-running it skips finished jobs and resumes the rest.
OmegaConf.register_new_resolver("agl_sweep_id", lambda: sweep_id(), use_cache=True)
OmegaConf.register_new_resolver("agl_job_dir", job_dir_name)
register_help_resolver(os.path.join(ROOT, "conf"))  # --help's list of the groups' choices (conf/hydra/help/agl.yaml)
register_configs()  # the typed schemas conf/'s defaults lists name (agl/config/schema.py)
# keys renamed since (algo.loss_type -> algo.loss.type, ...): Hydra reads sys.argv, so it gets the new names
sys.argv[1:], RENAMED = rename_overrides(sys.argv[1:])


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> object:
    # Python's advice for programs: a log line that cannot be written (the run dir's harness.log on a full
    # disk) is dropped, not printed as a traceback; the job itself says what failed (agl.errors.DiskFull).
    logging.raiseExceptions = False
    for line in RENAMED:  # one line each, in the run's log
        logging.getLogger("agl").warning(line)
    # A launcher's worker process (submitit's) runs this function without running this file: put the
    # checkout on sys.path there too, as `python harness.py` does, so tasks/ (task=hello, ...) imports.
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from agl.jobs.dispatch import run_job

    try:
        return run_job(cfg)
    except ConfigError as error:  # the user's to fix: say what, without a traceback
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    try:
        check_launcher(
            sys.argv[1:], os.path.join(ROOT, "conf")
        )  # before Hydra: its error for a missing launcher is a page long
        check_command_line(sys.argv[1:], os.path.join(ROOT, "conf"))  # a mistyped or ill-typed key: one line naming it
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    main()
