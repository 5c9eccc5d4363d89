"""What a researcher changes without editing agl: a loss, an advantage estimator or an algorithm, each one file.

- docs/algorithms.md's own loss and advantage (``my_losses.py``), written where a user would keep it, train in a real
  GRPO job run from that directory, and a wrong parameter of it is one line before the model loads;
- a built-in algorithm is its schema, its yaml and its job module, and nothing else lists it;
- ``algo=custom``'s arguments take the types its function annotates;
- the keys renamed by the loss and advantage registries still run, old command lines and old run dirs alike (the
  kill -9 test resumes a run dir rewritten to the old keys: tests/test_reproducible.py).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from agl.config import ALGO_SCHEMAS, GRPOConfig
from agl.config.renamed import rename_overrides, rename_saved
from agl.errors import ConfigError
from agl.jobs.custom import typed_args

ROOT = Path(__file__).resolve().parents[1]
MY_LOSSES = "# my_losses.py:"


def docs_block(page: str, first_line: str) -> str:
    """The fenced python block of ``page`` whose first line starts with ``first_line``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)
    found = [b for b in blocks if b.startswith(first_line)]
    assert len(found) == 1, f"{page} should hold one block starting {first_line!r}"
    return found[0]


@pytest.fixture
def my_losses(tmp_path, monkeypatch) -> Path:
    """The docs' example as the user's own file, in the directory the user runs from."""
    (tmp_path / "my_losses.py").write_text(docs_block("docs/algorithms.md", MY_LOSSES))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_losses", None)


JOB = [
    "model=tiny",
    "algo=grpo",
    "progress=false",
    "runner.n=8",
    "task=hello",
    "seed=3",
    "task.agent=crash_points:multi_turn_agent",  # rewards that differ within a group, so the loss runs
    "task.data=crash_points:load",
    "task.max_tokens=6",
    "+task.resources.max_turns=2",
    "task.eval_size=1",
    "algo.steps=1",
    "algo.eval_every=0",
    "algo.batch_size=2",
    "algo.group_size=4",
    "algo.lr=1e-2",
]


def harness(cwd: Path, *args: str):
    """``python harness.py *args`` run from ``cwd`` (the user's project), tests/ importable (the agent)."""
    from prefork import run

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    return run([*args], env, timeout=300, cwd=cwd)


def test_the_docs_own_loss_and_advantage_train_a_real_grpo_job(my_losses):
    run_dir = my_losses / "run"
    own = ["algo.loss.type=my_losses:tanh_clip", "algo.loss.scale=3", "algo.advantage=my_losses:rank"]
    result = harness(my_losses, *JOB, *own, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if row.get("samples_trained")]
    assert trained, rows  # at least one step had groups with unequal rewards: the loss and the advantage ran
    assert all(key in trained[0] for key in ("loss", "clip_ratio_low", "clip_ratio_high", "grad_norm"))
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml").algo
    assert saved.loss == {"type": "my_losses:tanh_clip", "scale": 3} and saved.advantage == "my_losses:rank"

    # a parameter the loss's dataclass lacks: one line naming what it takes, before the model loads
    result = harness(my_losses, *JOB, *own, "algo.loss.scal=3", f"hydra.run.dir={my_losses / 'typo'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: algo.loss.scal: not a parameter of loss 'tanh_clip' (it takes: scale)"
    )
    assert not (my_losses / "typo" / "store.sqlite").exists()


def test_the_docs_own_loss_and_advantage_give_what_they_say(my_losses):
    import torch

    from agl.train.advantages import advantages
    from agl.train.loss import LossInputs, micro_batch_loss, resolve_loss
    from agl.train.samples import Sample

    mine = importlib.import_module("my_losses")
    loss, params = resolve_loss({"type": "my_losses:tanh_clip", "scale": 2})
    assert loss is mine.tanh_clip and params == mine.TanhClip(scale=2.0)
    # on-policy (r = 1) it is the policy gradient: -A per token, weighted per token
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    value, stats = micro_batch_loss(
        loss, params, LossInputs.of(logp, logp.detach(), torch.tensor([3.0]), mask), mask / 2
    )
    value.backward()
    assert float(value.detach()) == -3.0 and logp.grad.tolist() == [[-1.5, -1.5]]
    assert float(stats["clip_ratio_high"]) == 0.0
    rewards = torch.tensor([0.0, 1.0, 1.0, 5.0])
    assert mine.rank(rewards, rewards).tolist() == [-1.0, 0.0, 0.0, 1.0]  # the reward's scale drops out
    samples = [
        Sample(
            rollout_id=str(i),
            prompt_ids=[1],
            completion_ids=[2],
            mask=[1],
            logprobs=[-1.0],
            reward=r,
            truncated=False,
            temperature=1.0,
            group="g",
        )
        for i, r in enumerate([0.0, 1.0, 1.0, 5.0])
    ]
    assert advantages(samples, mine.rank)[0] == [-1.0, 0.0, 0.0, 1.0]


def test_every_algorithm_is_its_schema_its_yaml_and_its_job():
    yamls = {path.stem for path in (ROOT / "conf" / "algo").glob("*.yaml")}
    assert set(ALGO_SCHEMAS) == yamls
    for name, schema in ALGO_SCHEMAS.items():
        defaults = OmegaConf.load(ROOT / "conf" / "algo" / f"{name}.yaml").defaults
        assert defaults[0] == f"{name}_schema", name
        assert callable(importlib.import_module(f"agl.jobs.{name}").run), name
        assert schema().name == name


def test_custom_algorithm_arguments_take_their_annotated_types():
    async def fn(store, k: int, temperature: float = 0.5, names: list[str] | None = None, free=None) -> None:
        pass

    assert typed_args(fn, {"k": "8", "temperature": 1, "names": ["a"], "free": "x"}) == {
        "k": 8,
        "temperature": 1.0,
        "names": ["a"],
        "free": "x",
    }
    with pytest.raises(ConfigError, match=r"algo.args.k='eight': Input should be a valid integer"):
        typed_args(fn, {"k": "eight"})


def test_old_command_lines_run_as_the_new_keys_with_one_warning_each():
    overrides, warnings = rename_overrides(
        ["algo=grpo", "algo.loss_type=sapo,grpo", "algo.sapo_tau_pos=1.2", "algo.scale_rewards=none", "algo.lr=1e-3"]
    )
    assert overrides == [
        "algo=grpo",
        "algo.loss.type=sapo,grpo",
        "algo.loss.tau_pos=1.2",
        "algo.advantage=dr_grpo",
        "algo.lr=1e-3",
    ]
    assert warnings == [
        "algo.loss_type is now algo.loss.type: running algo.loss.type=sapo,grpo (docs/algorithms.md)",
        "algo.sapo_tau_pos is now algo.loss.tau_pos: running algo.loss.tau_pos=1.2 (docs/algorithms.md)",
        "algo.scale_rewards is now algo.advantage: running algo.advantage=dr_grpo (docs/algorithms.md)",
    ]


def old_grpo_config(loss_type: str, scale_rewards: str = "group") -> dict:
    """``algo`` as a run saved it before the registries: every flat key, at the defaults of the time."""
    return {
        "name": "grpo",
        "loss_type": loss_type,
        "scale_rewards": scale_rewards,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "opmd_tau": 1.0,
        "sapo_tau_pos": 1.0,
        "sapo_tau_neg": 1.05,
        "lr": 2e-4,
    }


@pytest.mark.parametrize(
    "loss_type, scale, loss, advantage",
    [
        ("dapo", "group", {"type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}, "grpo"),
        ("sapo", "none", {"type": "sapo", "tau_pos": 1.0, "tau_neg": 1.05}, "dr_grpo"),
        ("opmd", "batch", {"type": "opmd", "tau": 1.0}, "grpo_batch"),
    ],
)
def test_an_old_run_dirs_config_maps_to_the_loss_it_ran(loss_type, scale, loss, advantage):
    from agl.config import to_typed
    from agl.train.grpo import check_update

    saved = OmegaConf.create({"algo": old_grpo_config(loss_type, scale), "task": {"name": "hello"}})
    algo = rename_saved(saved).algo
    assert OmegaConf.to_container(algo) == {"name": "grpo", "lr": 2e-4, "loss": loss, "advantage": advantage}
    typed = to_typed({"algo": OmegaConf.to_container(algo), "task": {"name": "t", "agent": "a:b", "data": "x"}})
    assert isinstance(typed.algo, GRPOConfig)
    check_update(typed.algo)
