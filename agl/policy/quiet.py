"""Quiet loading: no warnings or progress bars that a user cannot act on. No torch here (``import agl`` runs it)."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


def silence_bitsandbytes() -> None:
    """bitsandbytes logs a WARNING when it is imported without the optional `kernels` package (a
    faster CPU 4-bit kernel agl never uses: see ``agl.policy.load.keep_4bit_matmul_differentiable``):
    "Failed to load CPU gemm_4bit_forward from kernels-community". Everything works without it,
    so the line only confuses users. Run by ``import agl``, before anything in agl imports peft (which imports
    bitsandbytes), and again by ``agl.policy.quiet.quiet_loading``."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Hide transformers' per-tensor progress bars and a deprecation warning peft triggers.

    Loading the 135M model takes seconds; "Loading weights: 272/272" bars and transformers 5's
    "`is_gradient_checkpointing` is deprecated" (peft probes that attribute) are not actionable.
    """
    from transformers.utils import logging as hf_logging

    silence_bitsandbytes()  # again: callers may have reconfigured logging since agl was imported
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning
            )
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
