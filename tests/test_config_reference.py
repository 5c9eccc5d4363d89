"""docs/config-reference.md is generated from the typed schemas and conf/ (agl/config/reference.py): every key
has a doc, and the committed page is what the generator writes now."""

import difflib
import re
from pathlib import Path

import pytest

from agl.config.reference import COMMAND, reference, undocumented

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config-reference.md"


@pytest.fixture(scope="module")
def generated() -> str:
    return reference()


def test_every_schema_key_has_a_doc():
    missing = undocumented()
    assert not missing, f"schema keys without a doc (agl/config/schema.py: doc(default, text)): {', '.join(missing)}"


def test_the_committed_page_is_what_the_generator_writes(generated):
    committed = PAGE.read_text() if PAGE.exists() else ""
    if committed != generated:
        diff = "".join(
            list(
                difflib.unified_diff(
                    committed.splitlines(True), generated.splitlines(True), "committed", "generated", n=1
                )
            )[:40]
        )
        pytest.fail(f"docs/config-reference.md is stale; regenerate it with `{COMMAND}`:\n{diff}")


def row(page: str, key: str) -> str:
    """The table row of ``key`` (its first one: algo.* keys repeat per algo, in the order of conf/algo/)."""
    match = re.search(rf"^\| `{re.escape(key)}` \|.*$", page, re.MULTILINE)
    assert match, f"no row for {key}"
    return match.group(0)


def test_the_page_shows_the_yaml_defaults_next_to_the_schema_ones(generated):
    grpo = generated[generated.index("### `algo=grpo`") :]
    assert row(grpo, "algo.steps").startswith("| `algo.steps` | int | `30` | `${oc.select:task.recipe.steps,30}` |")
    assert row(grpo, "algo.warmup.steps").startswith("| `algo.warmup.steps` | int | `0` | `${oc.select:")
    assert "| `algo.weight_decay` | float | `0.0` |  | AdamW weight decay |" in grpo  # not set by grpo.yaml: empty
    gsm8k = next(line for line in generated.splitlines() if line.startswith("- **`task=gsm8k`**"))
    sets = generated.splitlines()[generated.splitlines().index(gsm8k) + 1]
    assert "`max_tokens`: `256`" in sets and "`recipe.steps`: `8`" in sets
    assert "`train_split`" not in sets  # gsm8k.yaml repeats the schema's "train": not a difference
    assert "`lora.r`: `8`" in generated  # model=tiny
    assert row(generated, "seed").startswith("| `seed` | int | `0` |")
    assert row(generated, "algo").startswith("| `algo` | group | `info` |")  # conf/config.yaml's choice


def test_every_group_and_section_has_a_heading(generated):
    headings = set(re.findall(r"^## (.+)$", generated, re.MULTILINE))
    assert {"top level", "runner", "engine", "server", "eval_cache", "model", "task", "algo"} <= headings
    for name in (p.stem for p in (ROOT / "conf" / "algo").glob("*.yaml")):
        assert f"### `algo={name}`" in generated
