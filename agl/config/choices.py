"""The real choices of conf/'s config groups (``model=``, ``task=``, ``algo=``), each with a one-line description.

A choice is a yaml file in ``conf/<group>/``; its description is the first line of the file's leading comment, so
the file is the one place it is written. The typed schemas that ``register_configs`` puts in the same groups
(``grpo_schema``, ...) are not files there, so they are not choices: Hydra's ``$APP_CONFIG_GROUPS`` lists them,
which is why ``python harness.py --help`` (conf/hydra/help/agl.yaml) lists these instead, through the
``agl_choices`` resolver. docs/config-reference.md (``agl.config.reference``) reads them too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

GROUP_ORDER = ("model", "task", "algo")  # conf/config.yaml's defaults order; any other group follows, by name


@dataclasses.dataclass(frozen=True)
class Choice:
    """One yaml file of a config group: ``task=gsm8k`` is ``Choice("task", "gsm8k", ...)``."""

    group: str
    name: str
    description: str  # the first line of the file's leading comment; "" when it has none
    path: Path


def description(path: Path) -> str:
    """The first line of the yaml file's leading comment (``# Grade-school math ...``), without the ``#``."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            return ""
        text = line.lstrip("#").strip()
        if text and not text.startswith("@package"):  # a Hydra directive is not a description
            return text
    return ""


def groups(conf_dir: str | Path) -> list[str]:
    """conf/'s config groups, Hydra's own (``hydra/``) left out."""
    found = [p.name for p in Path(conf_dir).iterdir() if p.is_dir() and p.name != "hydra"]
    return sorted(found, key=lambda g: (GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g))


def choices(conf_dir: str | Path, group: str) -> list[Choice]:
    """The yaml files of ``conf/<group>/``, by name."""
    return [
        Choice(group, path.stem, description(path), path) for path in sorted((Path(conf_dir) / group).glob("*.yaml"))
    ]


def default_choices(conf_dir: str | Path) -> dict[str, str]:
    """What conf/config.yaml's defaults list picks for each group (``{"model": "smollm2", ...}``)."""
    picked = {}
    for entry in OmegaConf.to_container(OmegaConf.load(Path(conf_dir) / "config.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            picked.update({str(k): str(v) for k, v in entry.items() if not str(k).startswith("override ")})
    return picked


def choices_text(conf_dir: str | Path) -> str:
    """The config groups for ``--help``: each group, its default, and each choice with its description."""
    defaults = default_choices(conf_dir)
    listed = {group: choices(conf_dir, group) for group in groups(conf_dir)}
    width = max((len(c.name) for group in listed.values() for c in group), default=0)
    lines = []
    for group, group_choices in listed.items():
        lines.append(f"{group}=<name>" + (f"   (default: {defaults[group]})" if group in defaults else ""))
        lines += [
            f"  {c.name:<{width}}  {c.description or '(no description: its yaml has no first comment line)'}"
            for c in group_choices
        ]
        lines.append("")
    # the help template is a string.Template (hydra._internal.hydra.Hydra.get_help): a literal $ is $$
    return "\n".join(lines).rstrip("\n").replace("$", "$$")


def register_help_resolver(conf_dir: str | Path) -> None:
    """``${agl_choices:}``: conf/hydra/help/agl.yaml's list of the groups' choices (``harness.py`` registers it)."""
    OmegaConf.register_new_resolver("agl_choices", lambda: choices_text(conf_dir), replace=True)
