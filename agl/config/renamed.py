"""Config keys that were renamed, so that old command lines and old run dirs keep working.

``algo=grpo``'s loss and advantage were flat keys (``algo.loss_type=sapo algo.sapo_tau_pos=1.0``,
``algo.scale_rewards=none``) until they became ``algo.loss`` (a loss by name and its parameters)
and ``algo.advantage`` (an estimator by name). ``rename_overrides`` rewrites a command line's old
keys, with one warning line each; ``rename_saved`` maps an old run's saved config, so that
``resume=`` of it runs what it ran before.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

# the old keys of algo=grpo -> their keys now (under algo.)
RENAMED = {
    "loss_type": "loss.type",
    "epsilon": "loss.epsilon",
    "epsilon_high": "loss.epsilon_high",
    "sapo_tau_pos": "loss.tau_pos",
    "sapo_tau_neg": "loss.tau_neg",
    "opmd_tau": "loss.tau",
    "scale_rewards": "advantage",
}
# scale_rewards' values -> the advantage estimators that compute the same
ADVANTAGE_OF_SCALE = {"group": "grpo", "batch": "grpo_batch", "none": "dr_grpo"}
# which of the old loss types took each old loss parameter (the seven built-in losses of the time)
_CLIPPED = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
_TAKEN_BY = {
    "epsilon": _CLIPPED,
    "epsilon_high": _CLIPPED,
    "sapo_tau_pos": ("sapo",),
    "sapo_tau_neg": ("sapo",),
    "opmd_tau": ("opmd",),
}

_OVERRIDE = re.compile(r"^(?P<prefix>[+~]{0,2})algo\.(?P<key>\w+)(?P<rest>=.*)?$")


def rename_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """A command line's overrides with the old keys renamed, and a warning line per renamed key.

    ``algo.scale_rewards=none`` becomes ``algo.advantage=dr_grpo`` (each value of a sweep's list too)."""
    out, warnings = [], []
    for override in overrides:
        match = _OVERRIDE.match(override)
        if not match or match["key"] not in RENAMED:
            out.append(override)
            continue
        old, new = f"algo.{match['key']}", f"algo.{RENAMED[match['key']]}"
        rest = match["rest"] or ""
        if match["key"] == "scale_rewards" and rest:
            values = [ADVANTAGE_OF_SCALE.get(v.strip(), v.strip()) for v in rest[1:].split(",")]
            rest = "=" + ",".join(values)
        out.append(f"{match['prefix']}{new}{rest}")
        warnings.append(f"{old} is now {new}: running {out[-1]} (docs/algorithms.md)")
    return out, warnings


def rename_saved(cfg: DictConfig) -> DictConfig:
    """An algo=grpo run's saved config with its old keys mapped (in place; also returned): the loss type and
    the parameters that loss took become ``algo.loss``, ``scale_rewards`` becomes ``algo.advantage``."""
    algo = cfg.get("algo")
    if algo is None or not any(key in algo for key in RENAMED):
        return cfg
    old = OmegaConf.to_container(algo, resolve=False)
    loss_type = old.pop("loss_type", None)
    loss = dict(old.get("loss") or {})
    if loss_type is not None:
        loss.setdefault("type", loss_type)
    for key, types in _TAKEN_BY.items():
        value = old.pop(key, None)
        if key in algo and loss.get("type") in types:
            loss.setdefault(RENAMED[key].split(".", 1)[1], value)
    if "scale_rewards" in old:
        scale = old.pop("scale_rewards")
        old.setdefault("advantage", ADVANTAGE_OF_SCALE.get(scale, scale))
    if loss:
        old["loss"] = loss
    with open_dict(cfg):
        cfg.algo = OmegaConf.create(old)
    return cfg
