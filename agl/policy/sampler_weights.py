"""A dense, LoRA-merged copy of the policy's linear layers, used only for sampling.

Through the training model, every linear layer of a decode step costs a 4-bit dequantize, a base matmul and two
LoRA matmuls, plus dtype casts around each: ~10 small ops x 210 layers, so a batch-32 decode step was op-overhead
bound (docs/benchmarks-history.md#sampler-merged-weights). The sampler instead holds
``W = dequant(W_4bit) + scale * B @ A`` as one dense matrix per layer in the compute dtype and runs one matmul per
layer.

What is shared, not copied: embeddings, norms, rotary buffers and the (tied) vocabulary
projection are the policy's own modules, so the residual stream and logits stay fp32
exactly as in training. That includes a LoRA on the embeddings or the head
(``model.lora.train_embeddings`` / ``train_head``): those layers run as the policy's own LoRA
modules, base plus LoRA in fp32, not merged (a merge would write into the shared, possibly tied,
vocabulary matrix). What differs: the LoRA product is rounded into the dense weight
(bf16 here) instead of being added in fp32. The trainer logs ``logprob_diff_abs`` (mean
|trainer logprob - sampler logprob| per token): on the hello task it rose a little, with the
same reward curve; ``engine.weights=adapter``
turns the merge off.

Cost: 2 bytes per base parameter in bf16, and one re-merge the first time the sampler runs
after the LoRA changed.
A change is noticed from the LoRA tensors themselves (their in-place version counters), so an
optimizer step, a checkpoint restore or a ``load_state_dict`` all invalidate the merge without
any caller having to remember to.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from peft import PeftModel


class DenseLinear(nn.Module):
    """``y = x @ W.T + b`` with W and b in the compute dtype; input and output keep x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def dense_linear(layer: nn.Module, dtype: torch.dtype, lora: bool = True) -> DenseLinear:
    """The layer as one dense matrix in ``dtype``: its dequantized base weight plus (``lora``)
    the active LoRA deltas, summed in fp32 and rounded once."""
    from peft.tuners.lora import LoraLayer

    wrapped = isinstance(layer, LoraLayer)
    base = layer.get_base_layer() if wrapped else layer
    weight = base_weight(base)
    if lora and wrapped and not layer.disable_adapters and not layer.merged:
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                weight = weight + layer.get_delta_weight(adapter).float()
    bias = None if base.bias is None else base.bias.detach().to(dtype)
    return DenseLinear(weight.to(dtype), bias)


def base_weight(base: nn.Module) -> torch.Tensor:
    """A linear layer's weight as a dense fp32 matrix, dequantized if it is a bitsandbytes one."""
    from peft.utils.integrations import dequantize_bnb_weight

    weight = base.weight
    if type(weight).__name__ in ("Params4bit", "Int8Params"):
        weight = dequantize_bnb_weight(weight, state=getattr(base, "state", None))
    return weight.detach().float()


def dense_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers to densify, by name: every (possibly LoRA-wrapped, possibly quantized)
    linear except the output embedding, which stays the policy's own fp32 module. A LoRA on
    the input embeddings is not a linear layer: it stays the policy's own too."""
    from peft.tuners.lora import LoraLayer

    output = model.get_output_embeddings()
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module.get_base_layer() if isinstance(module, LoraLayer) else module, nn.Linear)
        and module is not output
        and ".base_layer" not in name
        and ".lora_" not in name
    }


def _is_lora(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


class MergedSampler:
    """Builds and refreshes the dense sampling model; ``model()`` returns it up to date.

    The sampling model is a shallow copy of the policy's module tree in which each linear
    layer is replaced by a ``DenseLinear``; every other module (embeddings, norms, rotary,
    the output layer) is the policy's own object, hooks included.

    ``lora=False`` builds the frozen base model instead (the route's helper models, e.g. a judge
    or an answerer that must not be trained): dense base weights only, and the policy's LoRA
    embeddings or head replaced by their base layers. It never changes, so it is built once and
    the trainer never needs to pause it.
    """

    def __init__(self, peft_model: PeftModel, compute_dtype: torch.dtype, lora: bool = True):
        self.source = peft_model.get_base_model()  # the HF model with LoRA layers injected
        self.compute_dtype = compute_dtype
        self.lora = lora
        self.layers = dense_layers(self.source)
        self.sampler = self._copy_tree(self.source, "")
        self._lora_params = [p for n, p in self.source.named_parameters() if ".lora_" in n] if lora else []
        self._fingerprint: tuple | None = None

    def _copy_tree(self, module: nn.Module, prefix: str) -> nn.Module:
        if not self.lora and _is_lora(module) and prefix.rstrip(".") not in self.layers:
            return module.get_base_layer()  # a LoRA on the embeddings or the head: its frozen base
        if not any(name.startswith(prefix) for name in self.layers) and (
            self.lora or not any(map(_is_lora, module.modules()))
        ):
            return module  # nothing below is densified: shared, with its state (e.g. a LoRA's on/off switch)
        clone = copy.copy(module)
        clone._modules = {
            name: None
            if child is None
            else (child if f"{prefix}{name}" in self.layers else self._copy_tree(child, f"{prefix}{name}."))
            for name, child in module._modules.items()
        }
        return clone

    def _lora_fingerprint(self) -> tuple:
        """Changes whenever a LoRA weight does (in-place updates bump a tensor's version), or
        when the adapter is switched off (``Policy.reference``, which switches every layer)."""
        if not self.lora:
            return ()
        first = next(iter(self.layers.values()), None)
        return tuple((p.data_ptr(), p._version) for p in self._lora_params) + (
            getattr(first, "disable_adapters", False),
        )

    @torch.no_grad()
    def refresh(self) -> None:
        for name, layer in self.layers.items():
            owner, _, attr = name.rpartition(".")
            self.sampler.get_submodule(owner)._modules[attr] = dense_linear(layer, self.compute_dtype, self.lora)
        self._fingerprint = self._lora_fingerprint()

    def model(self) -> nn.Module:
        if self._fingerprint != self._lora_fingerprint():
            self.refresh()
        return self.sampler
