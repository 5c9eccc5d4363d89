"""agl's one entry point: `python harness.py task=gsm8k algo=grpo` (Hydra composes conf/).

Hydra owns config composition, overrides, sweeps (-m) and run dirs; agl.jobs owns the work.
Resume a run in place with `python harness.py resume=<run dir>`.
"""
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from agl.errors import ConfigError

# A resumed run writes into its own dir, and keeps the .hydra/ config it was started with.
OmegaConf.register_new_resolver("agl_run_dir", lambda resume, fresh: resume or fresh)
OmegaConf.register_new_resolver("agl_output_subdir", lambda resume: None if resume else ".hydra")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> object:
    from agl.jobs import run_job

    try:
        return run_job(cfg)
    except ConfigError as error:  # the user's to fix: say what, without a traceback
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
