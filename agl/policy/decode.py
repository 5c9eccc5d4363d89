"""One decode step of a Llama-family sampler (Llama, Qwen2), without the model's generic forward.

The engine's decode step feeds one token per row. Through transformers' forward that is, per
layer, three attention projections and two MLP input projections as separate matmuls, a 4-d
attention mask rebuilt from the 2-d one, rotary tables recomputed, plus the module and kwargs
plumbing around ~20 small ops; and every product as ``x @ W.T``. Here the step is written out
for this one shape:

  - q, k and v are one matmul against the three weights stacked, gate and up another: the
    sampler's dense weights are re-laid out once per merge, in place (each ``DenseLinear`` keeps
    a view into the stacked matrix, so no weight is stored twice);
  - the rotary cos/sin and the boolean attention mask are computed once per step, not per layer;
  - attention is ``scaled_dot_product_attention`` with the query heads of a key/value group
    packed as that group's "query length" (no ``repeat_kv`` copy of the cache);
  - every product is computed as ``W @ x.T`` (see ``_linear``).

Measured: BENCHMARKS.md "The decode step written out". The logits equal the model's forward to
float32 rounding (tests/test_decode.py checks 1e-5); the KV cache is the engine's, appended
through ``cache.update`` as the model's forward does, so prefill (still the model's forward),
merging and retiring rows are unchanged.

Forward hooks are honoured on the embeddings, the final norm and the output layer (called as
modules), not inside the decoder layers. Other architectures, a LoRA module left in place of a
dense layer (``engine.weights=adapter``), or a rotary embedding whose frequencies depend on the
length, or Qwen2's sliding window, fall back to the model's forward (``decode_step`` returns None).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from agl.policy.sampler_weights import DenseLinear

SUPPORTED = ("llama", "qwen2")  # Qwen2: the same step with biased q/k/v projections (DenseLinear keeps them)
STATIC_ROPE = ("default", "linear", "llama3")  # inv_freq fixed at load time


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic (float32 variance, weight applied in the input dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)


def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_major: bool = False
) -> torch.Tensor:
    """``x @ W.T + b`` computed as ``(W @ x.T).T``, in the weight's dtype, returned in the input's
    (DenseLinear's contract). With a few rows of x, MKL splits ``x @ W.T`` over the rows between
    the two threads, so each thread streams all of W; ``W @ x.T`` splits over W's rows. The result
    is a transposed view unless ``row_major``."""
    out = torch.mm(weight, x.to(weight.dtype).t()).t()
    if row_major:
        out = out.contiguous()
    if bias is not None:
        out = out + bias
    return out.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``, as transformers' apply_rotary_pos_emb."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _stack(modules: list[DenseLinear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One matrix holding the modules' weights one after another; each module's weight (and
    bias) becomes a view into it, so the old separate copies are freed."""
    weight = torch.cat([m.weight for m in modules])
    has_bias = [m.bias is not None for m in modules]
    bias = torch.cat([m.bias for m in modules]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in modules])
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m._buffers["weight"] = weight[start : start + rows]
        if bias is not None and m.bias is not None:
            m._buffers["bias"] = bias[start : start + rows]
        start += rows
    return weight, bias


class LlamaDecodeStep:
    """``step(tokens, positions, mask, cache) -> logits``: one token per row through ``sampler``
    (a ``MergedSampler``). ``mask`` [B, T] covers the cache plus the new token."""

    def __init__(self, sampler: Any):
        self.sampler = sampler
        self._first: nn.Module | None = None  # the q projection the stacks were built from
        self._layers: list[tuple] = []

    def _prepare(self, model: nn.Module) -> None:
        """(Re)build the stacked weights after a merge replaced the dense layers."""
        layers = model.model.layers
        if self._first is layers[0].self_attn.q_proj:
            return
        built = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _stack([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = _stack([mlp.gate_proj, mlp.up_proj])
            built.append(
                (layer.input_layernorm, qkv, attn.o_proj, layer.post_attention_layernorm, gate_up, mlp.down_proj)
            )
        self._layers = built
        self._first = layers[0].self_attn.q_proj

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        model = self.sampler.model()
        self._prepare(model)
        config = model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        group = heads // kv_heads
        rows = tokens.shape[0]
        rotary = model.model.rotary_emb
        device = rotary.inv_freq.device
        tokens, positions, mask = tokens.to(device), positions.to(device), mask.to(device)

        x = model.model.embed_tokens(tokens)  # [B, H]
        freqs = positions[:, None].float() * rotary.inv_freq.float()[None, :]  # [B, d/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * rotary.attention_scaling).to(x.dtype)[:, None, :]  # [B, 1, d]
        sin = (angles.sin() * rotary.attention_scaling).to(x.dtype)[:, None, :]
        attend = mask.bool()[:, None, None, :]  # [B, 1, 1, T]: shared by every head
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for index, (norm1, (w_qkv, b_qkv), o_proj, norm2, (w_gu, b_gu), down) in enumerate(self._layers):
            # row-major: SDPA's flash kernel needs unit stride in the last dim (else its math path)
            qkv = _linear(_rms_norm(x, norm1), w_qkv, b_qkv, row_major=True)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = _rotate(q.view(rows, heads, head_dim), cos, sin)
            k = _rotate(k.view(rows, kv_heads, head_dim), cos, sin)
            keys, values = cache.update(k[:, :, None, :], v.reshape(rows, kv_heads, 1, head_dim), index)
            out = F.scaled_dot_product_attention(
                q.view(rows, kv_heads, group, head_dim), keys, values, attn_mask=attend, scale=head_dim**-0.5
            )  # [B, kv_heads, group, d]: a group's query heads take the place of query positions
            x = x + _linear(out.reshape(rows, q_size), o_proj.weight, o_proj.bias)
            gate, up = _linear(_rms_norm(x, norm2), w_gu, b_gu).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, down.weight, down.bias)
        x = model.model.norm(x)
        head = model.lm_head
        if type(head) is nn.Linear and not (head._forward_hooks or head._forward_pre_hooks):
            return _linear(x, head.weight, head.bias, row_major=True).float().cpu()  # [B, V]
        return head(x).float().cpu()  # a LoRA head, or hooks on it (tests force tokens with one): the module itself


def decode_step(sampler: Any) -> LlamaDecodeStep | None:
    """The lean decode step for ``sampler``'s model, or None where it does not apply. Looks at
    the model's structure only: the merge itself still happens at the first forward pass."""
    if sampler is None:
        return None
    model = sampler.source
    config = model.config
    inner = getattr(model, "model", None)
    if config.model_type not in SUPPORTED or inner is None or getattr(config, "hidden_act", None) != "silu":
        return None
    if getattr(config, "use_sliding_window", False):  # Qwen2's sliding-window layers attend to a window only
        return None
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") not in STATIC_ROPE:
        return None
    prefix = next(name for name, module in model.named_modules() if module is inner)
    for i in range(len(inner.layers)):
        names = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        if not all(f"{prefix}.layers.{i}.{name}" in sampler.layers for name in names):
            return None
    return LlamaDecodeStep(sampler)
