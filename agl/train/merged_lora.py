"""LoRA layers run as one merged matmul in the update (``model.lora.train_merged``).

peft runs a LoRA linear as the base matmul, then ``x @ A.T``, ``@ B.T``, a scaling and an add,
each over every token: the [tokens, 16] products are skinny matmuls that run far below the
matmul peak, and the scaling and the add stream the layer's whole output twice more. Here the
layer's forward is one matmul with the merged weight ``W + scale * B @ A`` (built per call from
the 4-bit weight, as the sampler builds its dense copy: ``agl.policy.sampler_weights``); backward gives x its
gradient through the same merged weight, and A and B theirs from two skinny products:

    dB = scale * dy.T @ (x @ A.T)        dA = scale * (dy @ B).T @ x

The gradients are peft's, summed in another order; the activations kept for backward are the
same size. Measured (memory and time against peft's): docs/benchmarks-history.md#merged-lora-layers.

Within one ``merged_lora_layers`` block (an update, an SFT step) each merged weight is built once and kept:
the forward, its replay under activation checkpointing and the backward of every micro-batch use it, instead
of dequantizing the 4-bit weight and adding the LoRA product three times a micro-batch. A LoRA changed in
place (an optimizer step inside the block) is noticed by its tensors' version counters and merged again. The
weights are the same bytes as merged per call; they cost the dense model's size in the compute dtype for the
block's length (docs/benchmarks-history.md "An engine bound by the hardware").

``auto`` turns it on where the policy computes in float32, where the merged weight differs from
the base weight plus the LoRA product by fp32 rounding only, and it is then the very matrix the
sampler samples from. In bf16 the merge would round the adapter's small delta into bf16 weights:
a numerics change for training that was not validated, so ``auto`` leaves bf16 on peft's path.

Left out: dropout, DoRA and other LoRA variants, a LoRA bias, several active adapters, mixed
adapter batches, 8-bit base layers and the output layer; such a layer runs peft's own forward.

Where the LoRA stays peft's (the default in bf16), ``dequantized_4bit_layers`` keeps each 4-bit base
weight dequantized for the block instead: bitsandbytes dequantizes it in every forward, replay and backward
otherwise. The same matmuls on the same bytes (tests/test_merged_lora.py checks the gradients bit for bit).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from agl.policy.sampler_weights import base_weight


class _MergedLinear(torch.autograd.Function):
    """``y = x @ (W + scale * B @ A).T + bias`` with W rebuilt from ``base`` in forward and in backward
    (a 4-bit layer keeps no dense copy); gradients for x, A and B."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        lora_A: torch.Tensor,
        lora_B: torch.Tensor,
        base: torch.nn.Module,
        scale: float,
        dtype: torch.dtype,
        cache: dict,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, lora_A, lora_B)
        ctx.base, ctx.scale, ctx.dtype, ctx.cache = base, scale, dtype, cache
        bias = None if base.bias is None else base.bias.to(dtype)
        weight = _cached(cache, base, lora_A, lora_B, scale, dtype)
        return torch.nn.functional.linear(x.to(dtype), weight, bias).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x, lora_A, lora_B = ctx.saved_tensors
        needs_x, needs_A, needs_B = ctx.needs_input_grad[:3]  # e.g. the first layer's input has no gradient to take
        grad_x = grad_A = grad_B = None
        if needs_x:
            weight = _cached(ctx.cache, ctx.base, lora_A, lora_B, ctx.scale, ctx.dtype)
            grad_x = (grad_y.to(ctx.dtype) @ weight).to(x.dtype)
        grad_NO = grad_y.reshape(-1, grad_y.shape[-1]).to(lora_B.dtype)
        x_NI = x.reshape(-1, x.shape[-1]).to(lora_A.dtype)
        if needs_B:
            grad_B = (grad_NO.T @ (x_NI @ lora_A.T)).mul_(ctx.scale)
        if needs_A:
            grad_A = ((grad_NO @ lora_B).T @ x_NI).mul_(ctx.scale)
        return grad_x, grad_A, grad_B, None, None, None, None


def _cached(
    cache: dict, base: torch.nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """``_merged``, kept in ``cache`` (one ``merged_lora_layers`` block's) while the LoRA tensors are unchanged."""
    key = (lora_A.data_ptr(), lora_A._version, lora_B.data_ptr(), lora_B._version, scale, dtype)
    kept = cache.get(base)
    if kept is None or kept[0] != key:
        kept = cache[base] = (key, _merged(base, lora_A, lora_B, scale, dtype))
    return kept[1]


def _merged(
    base: torch.nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """The merged weight, summed in fp32 and rounded once, exactly as ``agl.policy.sampler_weights.dense_linear``."""
    delta = (lora_B.detach() @ lora_A.detach()).float().mul_(scale)
    return delta.add_(base_weight(base)).to(dtype)  # in place on the product (a sum is the same either way round)


def _forward(layer: Any, cache: dict, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    adapter = _plain_adapter(layer)
    if adapter is None or args or kwargs:  # anything but one plain LoRA: peft's own forward
        return type(layer).forward(layer, x, *args, **kwargs)
    base = layer.get_base_layer()
    dtype = getattr(base, "compute_dtype", None) or (
        base.weight.dtype if base.weight.is_floating_point() else x.dtype
    )  # as the base layer computes
    return _MergedLinear.apply(
        x, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, base, layer.scaling[adapter], dtype, cache
    )


def _plain_adapter(layer: Any) -> str | None:
    """The layer's one active adapter when it is a plain LoRA (no dropout, variant or bias) that is
    on and not merged into the base layer; else None."""
    if layer.disable_adapters or layer.merged or getattr(layer, "fan_in_fan_out", False):
        return None
    active = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(active) != 1:
        return None
    (adapter,) = active
    dropout = layer.lora_dropout[adapter]
    plain = isinstance(dropout, torch.nn.Identity) or (
        isinstance(dropout, torch.nn.Dropout) and (dropout.p == 0 or not dropout.training)
    )
    if not plain or adapter in getattr(layer, "lora_variant", {}) or layer.lora_B[adapter].bias is not None:
        return None
    return adapter


def merged_layers(model: Any) -> list[Any]:
    """The LoRA-wrapped linear layers of ``model`` that can run merged: all but the output layer and
    8-bit layers (bitsandbytes' int8 matmul quantizes the input too: merged, they would compute
    something else; measured: docs/benchmarks-history.md#merged-lora-layers)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    output = base.get_output_embeddings()
    return [
        module
        for module in base.modules()
        if isinstance(module, LoraLayer)
        and isinstance(module.get_base_layer(), torch.nn.Linear)
        and module is not output
        and type(module.get_base_layer().weight).__name__ != "Int8Params"
    ]


def _dequantized_forward(layer: Any, cache: dict, x: torch.Tensor) -> torch.Tensor:
    """``bitsandbytes.nn.Linear4bit.forward`` (its training path, ``MatMul4Bit``: ``x @ dequant(W).T`` in the
    compute dtype, ``grad_x = grad_y @ dequant(W)``) with the dequantized weight kept in ``cache``."""
    weight = cache.get(layer)
    if weight is None:
        weight = cache[layer] = base_weight(layer).to(layer.compute_dtype or x.dtype)
    bias = None if layer.bias is None else layer.bias.to(weight.dtype)
    return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


def dequantizable_4bit_layers(model: Any) -> list[Any]:
    """``model``'s bitsandbytes 4-bit linear layers (a LoRA's base layer or not)."""
    if not any(type(p).__name__ == "Params4bit" for p in model.parameters()):
        return []
    from bitsandbytes.nn import Linear4bit

    return [module for module in model.modules() if isinstance(module, Linear4bit)]


@contextlib.contextmanager
def dequantized_4bit_layers(model: Any, enabled: bool = True) -> Iterator[None]:
    """Within: each 4-bit base layer of ``model`` dequantizes its weight once, on first use, and keeps it in the
    compute dtype until the block ends (``enabled``). An update step or an SFT step runs every layer's forward,
    its checkpointed replay and its backward once per micro-batch; bitsandbytes dequantizes the weight in each.

    Cost: the layers' dense size in the compute dtype for the block's length (212 MB for SmolLM2-135M in bf16,
    what the sampler's dense copy holds too). A merged LoRA layer (``merged_lora_layers``) keeps its own."""
    with _forwards_replaced(dequantizable_4bit_layers(model) if enabled else [], _dequantized_forward):
        yield  # the cache: layer -> its dequantized weight


@contextlib.contextmanager
def merged_lora_layers(model: Any, enabled: bool = True) -> Iterator[None]:
    """Within: ``model``'s plain LoRA linear layers run as one merged matmul (``enabled``), each merged
    weight built once for the block (see the module's docstring)."""
    with _forwards_replaced(merged_layers(model) if enabled else [], _forward):
        yield  # the cache: base layer -> (the LoRA's tensors and versions, the merged weight)


@contextlib.contextmanager
def _forwards_replaced(layers: list[Any], forward: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Within: each of ``layers`` runs ``forward(layer, cache, x)``, one ``cache`` dict for the block, emptied after.
    An instance attribute: the class's forward stays as is."""
    cache: dict = {}
    for layer in layers:
        layer.forward = functools.partial(forward, layer, cache)
    try:
        yield
    finally:
        cache.clear()
        for layer in layers:
            del layer.forward
