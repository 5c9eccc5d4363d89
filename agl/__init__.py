"""agl: train LLM agents with reinforcement learning on one machine.

Agent code needs only ``LLM`` (the endpoint it is given), ``emit_reward``/``emit_metric``
and, optionally, the ``@rollout`` marker. ``run`` runs the harness from Python (a notebook).
"""
from __future__ import annotations

import logging
import os


def silence_bitsandbytes() -> None:
    """bitsandbytes logs a WARNING when it is imported without the optional `kernels` package (a
    faster CPU 4-bit kernel agl never uses: see ``agl.model.keep_4bit_matmul_differentiable``):
    "Failed to load CPU gemm_4bit_forward from kernels-community". Everything works without it,
    so the line only confuses users. Run here, before anything in agl imports peft (which imports
    bitsandbytes), and again by ``agl.model.quiet_loading``."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


silence_bitsandbytes()

from agl.agent import LLM, emit_metric, emit_reward, rollout  # noqa: E402 (after the logger is quiet)

__all__ = ["LLM", "emit_reward", "emit_metric", "rollout", "run"]


def run(*overrides: str, run_dir: str | os.PathLike | None = None) -> object:
    """``agl.run("task=hello", "algo=grpo", "algo.steps=2")``: ``python harness.py ...`` in this
    process, returning the job's result; ``run_dir=`` instead of outputs/<date>/<time>_<task>_<algo>.
    See ``agl.notebook`` (imported here, not with agl: it brings Hydra, and the job brings torch)."""
    from agl.notebook import run as run_harness

    return run_harness(*overrides, run_dir=run_dir)
