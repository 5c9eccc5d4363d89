"""agl: train LLM agents with reinforcement learning on one machine.

Agent code needs only ``LLM`` (the endpoint it is given), ``emit_reward``/``emit_metric``
and, optionally, the ``@rollout`` marker; an algorithm of your own reads a rollout's reward back with
``final_reward(spans)``, and reaches a store served over HTTP (``python harness.py algo=store``) with
``StoreClient(url, api_key=...)`` (async) or ``SyncStoreClient`` (blocking). ``run`` runs the harness from Python
(a notebook).
"""

from __future__ import annotations

import os

from agl.policy.quiet import silence_bitsandbytes  # noqa: E402 (no torch: logging only)

silence_bitsandbytes()  # before anything in agl imports peft (which imports bitsandbytes)

from agl.agents.api import LLM, emit_metric, emit_reward, final_reward, rollout  # noqa: E402 (after the logger is quiet)

__all__ = ["LLM", "emit_reward", "emit_metric", "final_reward", "rollout", "run", "StoreClient", "SyncStoreClient"]


def __getattr__(name: str) -> object:
    """``agl.StoreClient`` and ``agl.SyncStoreClient`` (agl/store/client.py), imported when first named: an agent
    that imports agl for ``emit_reward`` does not pay for the store's HTTP client."""
    if name in ("StoreClient", "SyncStoreClient"):
        from agl.store import client

        return getattr(client, name)
    raise AttributeError(f"module 'agl' has no attribute {name!r}")


def run(*overrides: str, run_dir: str | os.PathLike | None = None) -> object:
    """``agl.run("task=hello", "algo=grpo", "algo.steps=2")``: ``python harness.py ...`` in this
    process, returning the job's result; ``run_dir=`` instead of outputs/<date>/<time>_<task>_<algo>.
    See ``agl.notebook`` (imported here, not with agl: it brings Hydra, and the job brings torch)."""
    from agl.notebook import run as run_harness

    return run_harness(*overrides, run_dir=run_dir)
