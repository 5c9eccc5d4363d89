"""Load a task from its config: the agent function, its data splits and its resources.

A task config (conf/task/<name>.yaml) names the agent as ``module:function`` and the data as
either ``module:function`` (called with a split name) or a ``.jsonl`` path (one file for
every split, or a mapping split -> path). Resources are the agent's keyword arguments; the
prompt template under test is one of them (``prompt_template``).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from agl.errors import ConfigError


@dataclasses.dataclass
class Task:
    name: str
    agent: Callable
    load: Callable[[str], list[dict]]
    resources: dict
    prompts: dict[str, str]

    def resources_for(self, prompt: str) -> dict:
        if prompt not in self.prompts:
            raise ConfigError(f"task.prompt '{prompt}' is not one of this task's prompts: {', '.join(self.prompts)}")
        return {**self.resources, "prompt_template": self.prompts[prompt]}


def import_object(spec: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise ConfigError(f"'{spec}' should look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"cannot import '{spec}': {error}") from None


def jsonl_loader(data: Any) -> Callable[[str], list[dict]]:
    paths = {k: Path(v) for k, v in data.items()} if isinstance(data, dict) else None

    def load(split: str) -> list[dict]:
        path = paths.get(split) if paths is not None else Path(data)
        if path is None:
            raise ConfigError(f"task.data has no '{split}' split (has: {', '.join(paths)})")
        if not path.is_file():
            raise ConfigError(f"task.data file '{path}' does not exist")
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [{"id": f"{split}-{i}", **row} for i, row in enumerate(rows)]

    return load


def load_task(cfg: DictConfig) -> Task:
    data = OmegaConf.to_container(cfg.data, resolve=True) if isinstance(cfg.data, DictConfig) else cfg.data
    if isinstance(data, dict) or str(data).endswith(".jsonl"):
        load = jsonl_loader(data)
    else:
        load = import_object(str(data))
    return Task(
        name=cfg.name,
        agent=import_object(cfg.agent),
        load=load,
        resources=OmegaConf.to_container(cfg.get("resources") or {}, resolve=True),
        prompts=OmegaConf.to_container(cfg.get("prompts") or {"default": "{question}"}, resolve=True),
    )
