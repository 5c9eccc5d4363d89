"""`python harness.py --help` (conf/hydra/help/agl.yaml): a usage header, each config group's real choices with
the first comment line of their yaml, the everyday commands and the docs; not the typed schemas that share the
groups (``grpo_schema``), and not a dump of the config."""

import subprocess
import sys
from pathlib import Path

import pytest

from agl.config.choices import choices, choices_text, description, groups
from agl.config.schema import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(scope="module")
def help_text() -> str:
    result = subprocess.run(
        [sys.executable, "harness.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def yaml_choices() -> dict[str, dict[str, str]]:
    """conf/<group>/<name>.yaml and its first line, read here without agl's code: what --help must list."""
    return {
        group.name: {path.stem: path.read_text().splitlines()[0].lstrip("# ").strip() for path in group.glob("*.yaml")}
        for group in CONF.iterdir()
        if group.is_dir() and group.name != "hydra"
    }


def test_help_lists_each_real_choice_with_its_description(help_text):
    lines = help_text.splitlines()
    for group, listed in yaml_choices().items():
        assert any(line.startswith(f"{group}=<name>") for line in lines), group
        for name, first_line in listed.items():
            assert first_line, f"conf/{group}/{name}.yaml has no first comment line to describe it"
            assert any(line.split(None, 1) == [name, first_line] for line in lines), f"{group}={name}"


def test_help_has_the_usage_commands_and_docs_and_no_schemas_or_config_dump(help_text):
    assert help_text.startswith("agl: train LLM agents with RL on one machine")
    assert "Usage: python harness.py [group=choice ...] [key=value ...]" in help_text
    for command in ("algo=grpo", "algo=eval", " -m ", "resume=<run dir>", "report=", "algo=serve", "algo=export"):
        assert command in help_text, command
    assert "docs/config-reference.md" in help_text and "--hydra-help" in help_text
    assert "_schema" not in help_text
    assert "max_prefill_tokens" not in help_text and "== Config ==" not in help_text  # Hydra's default dumps it all
    assert len(help_text.splitlines()) <= 60  # about a screen; the composed config alone (--cfg job) is 87 lines


def test_the_schemas_hydra_lists_as_choices_are_not_choices_here():
    """Why --help lists conf/'s files itself: Hydra's own listing ($APP_CONFIG_GROUPS) has the schemas too."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path

    register_configs()
    hydra_listing = ConfigLoaderImpl(config_search_path=create_config_search_path(str(CONF))).get_group_options("algo")
    assert "grpo_schema" in hydra_listing
    assert [c.name for c in choices(CONF, "algo")] == sorted(n for n in hydra_listing if not n.endswith("_schema"))
    assert groups(CONF) == ["model", "task", "algo"]


def test_a_description_is_the_first_comment_line_and_a_dollar_survives_the_template(tmp_path):
    (tmp_path / "config.yaml").write_text("defaults:\n  - task: priced\n  - override hydra/help: agl\n")
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "priced.yaml").write_text("# @package _global_\n# Costs $5 a run.\n# More.\nname: priced\n")
    (tmp_path / "task" / "bare.yaml").write_text("name: bare\n# not a leading comment\n")
    assert description(tmp_path / "task" / "priced.yaml") == "Costs $5 a run."
    assert description(tmp_path / "task" / "bare.yaml") == ""
    text = choices_text(tmp_path)
    assert "task=<name>   (default: priced)" in text
    assert "priced  Costs $$5 a run." in text  # string.Template (Hydra's help) turns $$ back into $
    assert "bare    (no description: its yaml has no first comment line)" in text
