"""Load a task from its config: the agent function, its data splits and its resources.

A task config (conf/task/<name>.yaml) names the agent as ``module:function`` and the data as
either ``module:function`` (called with a split name) or a ``.jsonl`` path (one file for
every split, or a mapping split -> path). Resources are the agent's keyword arguments; the
prompt template under test is one of them (``prompt_template``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from agl.config import DEFAULT_PROMPTS, TaskConfig, typed
from agl.errors import ConfigError


@dataclasses.dataclass
class Task:
    name: str
    agent: Callable
    load: Callable[[str], list[dict]]
    resources: dict
    prompts: dict[str, str]
    demonstrations: Callable[..., list[list[dict]]] | None = None

    def resources_for(self, prompt: str) -> dict:
        if prompt not in self.prompts:
            raise ConfigError(f"task.prompt '{prompt}' is not one of this task's prompts: {', '.join(self.prompts)}")
        return {**self.resources, "prompt_template": self.prompts[prompt]}


def import_object(spec: str) -> Any:
    """``"package.module:attribute"`` -> the attribute."""
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise ConfigError(f"'{spec}' should look like 'package.module:function'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # a user's own agent next to where they run
        sys.path.append(cwd)
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


def call_with_accepted(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments its signature accepts (all of them if it has **kwargs)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def demonstrations_loader(spec: Any) -> Callable[..., list[list[dict]]] | None:
    """``task.demonstrations`` -> ``load(split, prompt_template=..., **resources)``, or None."""
    if not spec:
        return None
    if str(spec).endswith(".jsonl"):
        path = Path(str(spec))

        def load(split: str, **_: Any) -> list[list[dict]]:
            if not path.is_file():
                raise ConfigError(f"task.demonstrations file '{path}' does not exist")
            with open(path) as f:
                return [json.loads(line)["messages"] for line in f if line.strip()]

        return load
    fn = import_object(str(spec))
    return lambda split, **kwargs: call_with_accepted(fn, split, **kwargs)


def load_task(task: TaskConfig | Mapping[str, Any]) -> Task:
    """The task ``task`` (a ``TaskConfig``, or any mapping of its keys) describes: its agent and loaders imported."""
    task = typed(TaskConfig, task)
    for key in ("agent", "data"):
        if _missing(task, key):
            raise ConfigError(
                f"task.{key} is required for task '{task.name}': "
                "e.g. task.agent=my_module:my_agent task.data=my_data.jsonl"
            )
    data = _plain(task.data)
    if isinstance(data, dict) or str(data).endswith(".jsonl"):
        load = jsonl_loader(data)
    else:
        load = import_object(str(data))
    return Task(
        name=task.name,
        agent=import_object(task.agent),
        load=load,
        resources=dict(_plain(task.resources) or {}),
        prompts=dict(_plain(task.prompts) or DEFAULT_PROMPTS),
        demonstrations=demonstrations_loader(task.demonstrations),
    )


def _missing(task: Any, key: str) -> bool:
    if isinstance(task, DictConfig):
        return OmegaConf.is_missing(task, key)
    return getattr(task, key) == MISSING


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
