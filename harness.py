"""agl's one entry point: `python harness.py task=gsm8k algo=grpo` (Hydra composes conf/).

Hydra owns config composition, overrides, sweeps (-m) and run dirs; agl.jobs owns the work.
"""
import sys

import hydra
from omegaconf import DictConfig

from agl.errors import ConfigError


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
