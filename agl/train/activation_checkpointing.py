"""Activation checkpointing of the decoder layers for the update (``algo.gradient_checkpointing``).

Without it, a forward pass keeps every decoder layer's intermediate tensors for backward, for every token of the
micro-batch. Checkpointed, each layer keeps only its input, and backward runs the layer's forward again to get the
rest, one layer at a time: the activations of one layer instead of thirty, for one more forward pass of the decoder
(docs/benchmarks-history.md#activation-checkpointing). Same loss and gradients: the replay is the same computation
on the same inputs (tests/test_grpo_update.py checks it).

Why not transformers' own ``gradient_checkpointing_enable``: it drops the KV cache a layer is given
(``cache=None``), and the update's shared-prompt layout runs the completions against the prompt's
cache (``agl.train.forward.SharedPrompt``). Here the layer's cache entry is kept: before the replay it is put
back as it was before the layer's first run, so the replay appends the same keys and values once.
Non-reentrant ``torch.utils.checkpoint``: gradients also reach tensors the layer reads that are not
its inputs (the prompt's keys and values, the LoRA weights).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from agl.errors import ConfigError


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The policy's decoder layers (``get_decoder().layers`` of the HF model under the LoRA)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"gradient_checkpointing: {type(base).__name__} has no decoder layers (get_decoder().layers)")
    return layers


def _checkpointed(layer: torch.nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    index = getattr(getattr(layer, "self_attn", None), "layer_idx", None)

    def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # no backward will replay it: as is
            return forward(hidden_states, *args, **kwargs)
        cache = kwargs.get("cache")
        if cache is not None and index is None:
            raise ConfigError(
                f"gradient_checkpointing: {type(layer).__name__} is given a KV cache but names no self_attn.layer_idx"
            )
        before = copy.copy(cache.layers[index]) if cache is not None and index < len(cache.layers) else None
        runs = 0

        def body(hidden: torch.Tensor) -> Any:
            nonlocal runs
            if runs and cache is not None:  # the replay: the layer's cache entry as before its first run
                if before is not None:
                    cache.layers[index] = copy.copy(before)
                else:
                    del cache.layers[index:]
            runs += 1
            return forward(hidden, *args, **kwargs)

        return checkpoint(body, hidden_states, use_reentrant=False)

    return run


@contextlib.contextmanager
def checkpointed_layers(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within: every decoder layer of ``model`` runs checkpointed when gradients are on (``enabled``)."""
    if not enabled:
        yield
        return
    layers = list(decoder_layers(model))
    for layer in layers:
        layer.forward = _checkpointed(layer, layer.forward)  # an instance attribute: the class's forward stays as is
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
