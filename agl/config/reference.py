"""docs/config-reference.md, generated: every key of the typed schemas (agl/config/schema.py) with its type, default
and doc (the field's ``metadata["doc"]``), and what conf/'s yaml sets instead (a task's recipe, an algo's
``${task.max_tokens}``), found by composing each choice with Hydra and comparing it with the schema's defaults.

    python -m agl.config.reference > docs/config-reference.md

tests/test_config_reference.py fails when the committed page differs from this module's output.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from agl.config.choices import Choice, choices, default_choices, groups
from agl.config.schema import ALGO_SCHEMAS, Config, ModelConfig, TaskConfig, register_configs

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
COMMAND = "python -m agl.config.reference > docs/config-reference.md"
GROUP_SCHEMAS = {"model": ModelConfig, "task": TaskConfig}  # algo: ALGO_SCHEMAS, by the composed algo.name
LONG_VALUE = 72  # characters of a value a table shows; the yaml file holds the rest


def undocumented() -> list[str]:
    """``Class.key`` of every schema key without a doc: the top level's, the groups', every algo's and every
    schema nested in them (``LoraConfig``, ``SFTConfig`` as ``algo.warmup``, ...)."""
    todo, seen, missing = [Config, *GROUP_SCHEMAS.values(), *ALGO_SCHEMAS.values()], set(), []
    while todo:
        schema = todo.pop(0)
        if schema in seen:
            continue
        seen.add(schema)
        for f in dataclasses.fields(schema):
            if not str(f.metadata.get("doc", "")).strip():
                missing.append(f"{schema.__name__}.{f.name}")
            nested = nested_schema(schema, f.name)
            if nested is not None:
                todo.append(nested)
    return missing


def nested_schema(schema: type, key: str) -> type | None:
    """The dataclass that ``schema.key`` holds (``Optional[TinyConfig]`` included), else None."""
    hint = typing.get_type_hints(schema)[key]
    for candidate in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def type_name(schema: type, key: str) -> str:
    """The key's type as a reader says it: ``int``, ``str or null``, ``any``."""
    hint = typing.get_type_hints(schema)[key]
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) is typing.Union and type(None) in args
    if nullable:
        hint = next(a for a in args if a is not type(None))
    if hint is Any:
        name = "any"
    elif dataclasses.is_dataclass(hint):
        name = "section"
    elif typing.get_origin(hint) is dict:
        name = "mapping"
    else:
        name = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
        name = name or str(hint).replace("typing.", "")
    return f"{name} or null" if nullable else name


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b": leaf}``; an empty mapping is a leaf (``{}``)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def defaults_of(schema: type) -> dict[str, Any]:
    """``schema``'s defaults, flattened: ``{"lora.r": 16, ...}``."""
    return flat(OmegaConf.to_container(OmegaConf.structured(schema), resolve=False))


def compose(overrides: list[str]) -> dict[str, Any]:
    """conf/config.yaml composed with ``overrides``, interpolations left as written (inside ``reference``'s
    ``initialize_config_dir``: one Hydra initialisation for every choice)."""
    from hydra import compose as hydra_compose

    return OmegaConf.to_container(hydra_compose("config", overrides=overrides), resolve=False)


def differences(composed: dict[str, Any], schema: type) -> dict[str, Any]:
    """The flattened keys whose composed value is not ``schema``'s default: what the yaml sets."""
    defaults = defaults_of(schema)
    return {k: v for k, v in flat(composed).items() if k not in defaults or defaults[k] != v}


def value_text(value: Any) -> str:
    """A value as a code span, as yaml writes it (``null``, ``true``, ``[a, b]``); a long one cut with an ellipsis."""
    if value == MISSING:
        return "required (`???`)"
    if isinstance(value, str):
        text = json.dumps(value)[1:-1] if ("\n" in value or value != value.strip() or not value) else value
        text = text or '""'
    else:
        text = json.dumps(value)
    if len(text) > LONG_VALUE:
        text = text[: LONG_VALUE - 1] + "…"
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`"


def doc_text(text: str) -> str:
    """Doc text in a markdown table cell: pipes, angle brackets and asterisks kept literal."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def table(schema: type, prefix: str, defaults: dict[str, Any], sets: dict[str, Any], sets_label: str) -> list[str]:
    """One row per key of ``schema`` (its section at ``prefix``); a column for what a yaml sets, when it sets any."""
    rows = [(f, f"{prefix}{f.name}", nested_schema(schema, f.name)) for f in dataclasses.fields(schema)]
    shown = {path: sets[path] for _, path, nested in rows if nested is None and path in sets}
    header = ["Key", "Type", "Default"] + ([sets_label] if shown else []) + ["Doc"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for f, path, nested in rows:
        if nested is None:
            inside = {k[len(path) + 1 :]: v for k, v in defaults.items() if k.startswith(path + ".")}
            default = value_text(defaults[path] if path in defaults or not inside else inside)
        else:  # its own table follows
            default = "`null`" if defaults.get(path, "") is None else ""
            default += (", " if default else "") + f"[`{path}.*`](#{anchor(path + '.*')})"
        row = [f"`{path}`", type_name(schema, f.name), default]
        if shown:
            row.append(value_text(shown[path]) if path in shown else "")
        lines.append("| " + " | ".join([*row, doc_text(f.metadata.get("doc", ""))]) + " |")
    return lines


def anchor(title: str) -> str:
    """The id a heading gets (Python-Markdown's toc, which mkdocs uses, and GitHub alike for these titles):
    lower case, word characters, dashes and underscores only, spaces as dashes."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " _-")
    return "-".join(kept.split())


def section(
    level: int, schema: type, prefix: str, defaults: dict[str, Any], sets: dict[str, Any], sets_label: str
) -> list[str]:
    """The schema's docstring and table, then a headed section per nested schema (``model.lora.*``)."""
    lines = [" ".join(schema.__doc__.split()), ""] if schema.__doc__ else []
    lines += [*table(schema, prefix, defaults, sets, sets_label), ""]
    for f in dataclasses.fields(schema):
        nested = nested_schema(schema, f.name)
        if nested is None:
            continue
        inner = f"{prefix}{f.name}."
        inner_defaults = {k: v for k, v in defaults.items() if k.startswith(inner)} or {
            inner + k: v for k, v in defaults_of(nested).items()
        }  # a section whose default is null (model.tiny): its schema's own defaults, for when it is set
        lines += ["#" * level + f" `{inner}*`", ""]
        lines += section(level + 1, nested, inner, inner_defaults, sets, sets_label)
    return lines


def choice_sets(choice: Choice, picked: str | None, sets: dict[str, Any]) -> list[str]:
    """A bullet for a group's choice: its description and the keys its yaml sets."""
    mark = " (the default)" if choice.name == picked else ""
    lines = [f"- **`{choice.group}={choice.name}`**{mark}: {doc_text(choice.description)}"]
    if sets:
        lines.append("  Sets " + ", ".join(f"`{k}`: {value_text(v)}" for k, v in sets.items()) + ".")
    return lines


def reference() -> str:
    """The whole page."""
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return page()


def page() -> str:
    """The page's text; Hydra is initialised on conf/ (``reference``)."""
    picked = default_choices(CONF_DIR)
    lines = [
        "# Config reference",
        "",
        f"<!-- Generated by `{COMMAND}` from agl/config/schema.py and conf/. Do not edit:",
        "     tests/test_config_reference.py fails when this page differs from what that command writes. -->",
        "",
        "Every key agl reads, with its type, its default and what it does. The defaults live in the typed schemas",
        "(`agl/config/schema.py`); where a group's yaml in `conf/` sets another value, it is shown next to them.",
        "Set any key on the command line: `python harness.py task=gsm8k algo=grpo algo.lr=1e-4 runner.n=16`; a",
        "mistyped key is an error that names it. `python harness.py --cfg job ...` prints the config a command",
        "line composes, and `python harness.py --help` lists the groups' choices.",
        "",
        "In yaml values, `${task.max_tokens}` is the task's value, `${oc.select:task.recipe.steps,30}` is that key",
        "if the task sets it and else 30, and `${oc.env:AGL_CACHE,...}` reads an environment variable.",
        "",
    ]
    sections = ["top level", *(f.name for f in dataclasses.fields(Config) if nested_schema(Config, f.name))]
    sections += groups(CONF_DIR)
    lines += ["Sections: " + ", ".join(f"[{name}](#{anchor(name)})" for name in sections) + ".", ""]
    lines += ["## top level", "", " ".join(Config.__doc__.split()), ""]
    lines += ["| Key | Type | Default | Doc |", "|---|---|---|---|"]
    defaults = defaults_of(Config)
    for f in dataclasses.fields(Config):
        if nested_schema(Config, f.name) is not None:
            continue
        if f.name in picked:
            kind, default = "group", f"`{picked[f.name]}`"
        else:
            kind, default = type_name(Config, f.name), value_text(defaults[f.name])
        lines.append(f"| `{f.name}` | {kind} | {default} | {doc_text(f.metadata['doc'])} |")
    lines.append("")
    composed = {k: v for k, v in compose([]).items() if k not in picked}
    top_sets = differences(composed, Config)  # what conf/config.yaml sets itself (none of its groups)
    for f in dataclasses.fields(Config):
        nested = nested_schema(Config, f.name)
        if nested is not None:
            prefix = f"{f.name}."
            lines += [f"## {f.name}", ""]
            lines += section(
                3, nested, prefix, {k: v for k, v in defaults.items() if k.startswith(prefix)}, top_sets, "config.yaml"
            )
    for group in groups(CONF_DIR):
        lines += group_section(group, picked.get(group))
    return "\n".join(lines).rstrip("\n") + "\n"


def group_section(group: str, picked: str | None) -> list[str]:
    """A group's keys and its choices: ``model`` and ``task`` have one schema, each ``algo`` choice its own."""
    listed = choices(CONF_DIR, group)
    lines = [f"## {group}", ""]
    if group in GROUP_SCHEMAS:
        schema = GROUP_SCHEMAS[group]
        lines += section(3, schema, f"{group}.", flat(defaults_of(schema), f"{group}."), {}, "")
        lines += [f"### `{group}=<name>`: what each choice sets", ""]
        for choice in listed:
            lines += choice_sets(choice, picked, differences(compose([f"{group}={choice.name}"])[group], schema))
        return [*lines, ""]
    lines += [
        f"Each `{group}=<name>` has its own schema; a column shows what `conf/{group}/<name>.yaml` sets instead of",
        "the schema's default.",
        "",
    ]
    for choice in listed:
        composed = compose([f"{group}={choice.name}"])[group]
        schema = ALGO_SCHEMAS.get(str(composed.get("name")))
        mark = " (the default)" if choice.name == picked else ""
        lines += [f"### `{group}={choice.name}`{mark}", ""]
        if schema is None:  # a yaml of the user's own, with no typed schema
            lines += [doc_text(choice.description), "", "No typed schema: its yaml holds its keys.", ""]
            continue
        sets = {f"{group}.{k}": v for k, v in differences(composed, schema).items()}
        lines += section(
            4, schema, f"{group}.", flat(defaults_of(schema), f"{group}."), sets, f"{choice.name}.yaml sets"
        )
    return lines


def main() -> None:
    sys.stdout.write(reference())


if __name__ == "__main__":
    main()
