"""Deprecated: the GRPO update moved to ``agl.train.grpo``, its config to ``agl.config``. This name keeps old
imports working (``agl.grpo.GRPOConfig``)."""

from agl.config import GRPOConfig
from agl.train.grpo import GRPOUpdate, advantages, drop_groups

__all__ = ["GRPOConfig", "GRPOUpdate", "advantages", "drop_groups"]
