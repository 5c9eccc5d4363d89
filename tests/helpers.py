"""Helpers shared by test modules: the project's Hydra config as a test composes it, and the tiny policy in
eval mode."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from agl.config import Config, to_typed

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_cfg(overrides: Sequence[str] = ()) -> DictConfig:
    """conf/config.yaml with ``overrides``, as Hydra composes it for ``harness.py`` (untyped, unresolved)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def typed_cfg(overrides: Sequence[str] = ()) -> Config:
    """``compose_cfg(overrides)`` through the jobs' one conversion (``agl.config.to_typed``)."""
    return to_typed(compose_cfg(overrides))


def eval_policy(model_cfg, device):
    """The policy of ``model_cfg`` (the tiny one: conftest's ``tiny_model_cfg``) on ``device``, in eval mode."""
    from agl.policy.load import load_policy  # torch: only for the tests that load a policy

    policy = load_policy(model_cfg, device)
    policy.model.eval()
    return policy
