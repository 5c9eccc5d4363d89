"""The typed configs (agl/config/schema.py) are the one home of defaults; a mistyped override fails naming its key."""

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agl.config import (
    ALGO_SCHEMAS,
    EngineConfig,
    GRPOConfig,
    SFTConfig,
    check_command_line,
    compose_checked,
    typed,
)
from agl.errors import ConfigError
from agl.jobs.dispatch import resumed_config

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.lrr=1", "algo.lrr"),
        ("+algo.lrr=1", "algo.lrr"),
        ("algo.warmup.lrr=1", "algo.warmup.lrr"),
        ("runner.nn=1", "runner.nn"),
        ("engine.weight=adapter", "engine.weight"),
        ("server.prot=1", "server.prot"),
        ("seeed=1", "seeed"),
        ("model.lora.rr=4", "model.lora.rr"),
        ("+task.foo=1", "task.foo"),
    ],
)
def test_a_mistyped_key_in_each_typed_group_is_rejected_by_name(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        compose_checked(CONF, ["algo=grpo", override])


@pytest.mark.parametrize("algo", sorted(ALGO_SCHEMAS))
def test_every_algo_is_typed_and_rejects_a_typo(algo):
    cfg = compose_checked(CONF, [f"algo={algo}"])
    assert OmegaConf.get_type(cfg.algo) is ALGO_SCHEMAS[algo] and cfg.algo.name == algo
    with pytest.raises(ConfigError, match=r"algo\.lrr"):
        compose_checked(CONF, [f"algo={algo}", "algo.lrr=1"])


def test_typed_fills_a_partial_section_from_its_schema_and_rejects_what_it_cannot_hold():
    partial = typed(SFTConfig, {"steps": 3})
    assert partial.steps == 3 and partial.lr == SFTConfig().lr and typed(SFTConfig, partial) is partial
    with pytest.raises(ConfigError, match=r"steps.*SFTConfig"):
        typed(SFTConfig, {"steps": "many"})
    with pytest.raises(ConfigError, match=r"stepz.*SFTConfig"):
        typed(SFTConfig, {"stepz": 3})


def test_a_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match=r"algo\.lr: .*abc"):
        compose_checked(CONF, ["algo=grpo", "algo.lr=abc"])
    with pytest.raises(ConfigError, match=r"runner\.n"):
        compose_checked(CONF, ["runner.n=many"])


def test_open_dicts_of_a_task_take_new_keys():
    cfg = compose_checked(CONF, ["task=hello", "+task.resources.max_turns=3", "+task.prompts.marked='x {question}'"])
    assert cfg.task.resources.max_turns == 3 and cfg.task.prompts.marked == "x {question}"


def test_the_command_line_check_is_one_line_naming_the_key():
    """What harness.py checks before Hydra runs (tests/test_harness.py runs the command line: exit code 2)."""
    with pytest.raises(ConfigError) as error:
        check_command_line(["algo=grpo", "algo.lrr=1"], CONF)
    assert "algo.lrr" in str(error.value) and "\n" not in str(error.value), str(error.value)


def resolved(*overrides):
    return OmegaConf.to_container(compose_checked(CONF, list(overrides)), resolve=True)


def test_grpo_config_defaults_are_the_composed_yaml():
    """GRPOConfig() is what algo=grpo runs; keys the yaml takes from the task are compared for a task
    without a recipe and with max_tokens set to the dataclass's."""
    algo = resolved("algo=grpo", "task=hello", f"task.max_tokens={GRPOConfig.max_tokens}")["algo"]
    assert algo == dataclasses.asdict(GRPOConfig())
    sft = resolved("algo=sft", "task=hello", f"task.max_tokens={SFTConfig.max_tokens}")["algo"]
    assert sft == dataclasses.asdict(SFTConfig())
    top = resolved()
    assert top["engine"] == dataclasses.asdict(EngineConfig())


def test_a_run_saved_before_a_key_existed_resumes_with_its_default(tmp_path):
    cfg = OmegaConf.to_container(compose_checked(CONF, ["algo=grpo", "model=tiny"]))
    del (
        cfg["engine"]["weights"],
        cfg["engine"]["batch_invariant"],
        cfg["runner"]["processes"],
        cfg["algo"]["old_logprobs"],
    )
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(OmegaConf.create(cfg), tmp_path / ".hydra" / "config.yaml")
    loaded = resumed_config(OmegaConf.create({"resume": str(tmp_path)}))
    assert loaded.engine.weights == "merged" and loaded.engine.batch_invariant == "auto"
    assert loaded.runner.processes == 0 and loaded.algo.old_logprobs == "recorded" and loaded.resume == str(tmp_path)
    assert loaded.algo.steps == 8 and loaded.algo.max_tokens == 256  # its interpolations still resolve (gsm8k's recipe)
