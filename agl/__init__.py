"""agl: train LLM agents with reinforcement learning on one machine.

Agent code needs only ``LLM`` (the endpoint it is given), ``emit_reward``/``emit_metric``
and, optionally, the ``@rollout`` marker.
"""
from agl.agent import LLM, emit_metric, emit_reward, rollout

__all__ = ["LLM", "emit_reward", "emit_metric", "rollout"]
