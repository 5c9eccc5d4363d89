"""Checking a command line before Hydra runs it: a mistyped or ill-typed key is one ``error:`` line naming
it, not Hydra's paragraph (``harness.py`` calls ``check_command_line``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agl.config.schema import SCHEMA_NAMES, register_configs
from agl.errors import ConfigError


def extra_keys(cfg: Any, path: str = "") -> list[str]:
    """Keys of typed nodes that their dataclass lacks (``+algo.lrr=1`` adds one past Hydra's check)."""
    found = []
    if not isinstance(cfg, DictConfig):
        return found
    schema = OmegaConf.get_type(cfg)
    fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in cfg.keys():
        full = f"{path}.{key}" if path else str(key)
        if fields is not None and key not in fields:
            found.append(f"{full} (not a key of {schema.__name__})")
        elif not OmegaConf.is_missing(cfg, key) and not OmegaConf.is_interpolation(cfg, key):
            found += extra_keys(cfg._get_node(key), full)
    return found


def compose_checked(conf_dir: str, overrides: list[str]) -> DictConfig:
    """Hydra's compose, with a mistyped or ill-typed override as a one-line ConfigError naming the key."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    register_configs()
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose("config", overrides=list(overrides))
    except ConfigCompositionException as error:
        cause = error.__cause__
        if not isinstance(cause, OmegaConfBaseException) or not getattr(cause, "full_key", None):
            raise
        where = next(
            (
                w
                for w in (getattr(cause, "object_type_str", None), getattr(cause, "ref_type_str", None))
                if w in SCHEMA_NAMES
            ),
            None,
        )
        first = str(getattr(cause, "msg", cause)).splitlines()[0]
        if isinstance(cause, (KeyError, AttributeError)) and where:
            message = f"{cause.full_key}: no such key in {where} (a typo? agl/config/schema.py lists its keys)"
        elif isinstance(cause, (KeyError, AttributeError)):
            message = f"{cause.full_key}: no such key (a typo? +{cause.full_key}=... adds one)"
        else:
            message = f"{cause.full_key}: {first}" + (f" ({where})" if where else "")
        raise ConfigError(message) from None
    extra = extra_keys(cfg)
    if extra:
        raise ConfigError(f"{extra[0]}: + adds keys to untyped configs only (task.resources, algo.args, ...)")
    return cfg


def check_command_line(argv: list[str], conf_dir: str) -> None:
    """Before Hydra runs: compose each job of the command line, so a typo is one ``error:`` line, not
    Hydra's paragraph. Anything this does not understand (other flags, glob sweeps) is left to Hydra."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    arguments, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        if arg in ("--cfg", "-c"):
            rest = rest[1:]
        elif arg in ("-m", "--multirun", "--resolve"):
            continue
        elif arg.startswith("-"):
            return  # --config-name, --info, ...: Hydra's business
        elif not arg.startswith("hydra"):  # hydra.* and hydra/... are Hydra's own config
            arguments.append(arg)
    try:
        jobs = [
            job
            for batch in BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(arguments), None)
            for job in batch
        ]
    except HydraException:
        return
    for job in jobs[:64]:
        compose_checked(conf_dir, list(job))
