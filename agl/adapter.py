"""Deprecated: spans to samples moved to ``agl.train.samples``, and ``final_reward`` to ``agl.agents.api``.
This name keeps old imports working (``from agl.adapter import final_reward, spans_to_samples``)."""

from agl.agents.api import REWARD_SPAN, final_reward
from agl.train.samples import LLM_SPAN_NAMES, Sample, is_policy_call, sampling_temperature, spans_to_samples

__all__ = [
    "LLM_SPAN_NAMES",
    "REWARD_SPAN",
    "Sample",
    "final_reward",
    "is_policy_call",
    "sampling_temperature",
    "spans_to_samples",
]
