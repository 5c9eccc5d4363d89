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

Why: docs/benchmarks-history.md#decode-step-written-out. The logits equal the model's forward to float32 rounding
(tests/test_decode.py checks 1e-5); the KV cache is the engine's, appended through ``cache.update`` as the model's
forward does, so prefill (still the model's forward), merging and retiring rows are unchanged.

With few rows (``quantized_rows``: ``engine.decode_4bit_rows``) a step is bound by streaming its weights
from memory, and the dense bf16 copy is four times the bytes of the policy's own NF4 base. There each
matmul group reads the NF4 base through bitsandbytes' CPU 4-bit kernel and adds the LoRA in float32,
as the trainer computes it (``Nf4Projection``); more rows run the dense copy, where the kernel's
per-row dequantizing costs more than the bytes saved (docs/benchmarks-history.md#nf4-few-row-decode).

Forward hooks are honoured on the embeddings, the final norm and the output layer (called as
modules), not inside the decoder layers. Other architectures, a LoRA module left in place of a
dense layer (``engine.weights=adapter``), or a rotary embedding whose frequencies depend on the
length, or Qwen2's sliding window, fall back to the model's forward (``decode_step`` returns None).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from agl.policy.sampler_weights import DenseLinear, MergedSampler

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


class Nf4Projection:
    """A stack of LoRA-wrapped NF4 layers (q/k/v, or gate/up, or one layer) as the trainer computes them:
    ``bf16(x) @ dequant(W_nf4).T`` (+ bias) in the compute dtype, plus ``scale * (x @ A.T) @ B.T`` in float32.

    The base matmul is bitsandbytes' CPU kernel over its repacked NF4 layout (``_convert_weight_packed_for_cpu``:
    0.5 bytes a weight, block scales in bf16: the one rounding the trainer's dequantize does not make); the
    layers' NF4 bytes and block scales are concatenated row-wise first, which is the stacked matrix quantized
    blockwise since a block never crosses a row. The LoRAs of the stack run as one product against their A
    matrices stacked and one against their B matrices laid block-diagonally (zeros add nothing). Rebuilt
    ``lora`` parts after every update; the NF4 part never changes."""

    def __init__(self, packed: torch.Tensor, state: Any, bias: torch.Tensor | None):
        self.packed, self.state, self.bias = packed, state, bias
        self.lora: tuple[torch.Tensor, torch.Tensor, float] | None = None  # (A stacked, B block-diagonal, scale)
        self._kernel = _nf4_kernel()
        rows, columns = state.shape
        self._fixed = [
            ctypes.c_int64(rows),
            ctypes.c_int64(columns),
            ctypes.c_void_p(packed.data_ptr()),
            ctypes.c_void_p(state.absmax.data_ptr()),
        ]

    @classmethod
    def build(cls, modules: list[nn.Module]) -> Nf4Projection | None:
        """From the sampler's source layers (LoRA-wrapped or not), or None where the kernel does not apply."""
        try:
            from bitsandbytes.functional import QuantState, _convert_weight_packed_for_cpu, dequantize_blockwise
        except ImportError:
            return None
        bases = [_base_layer(m) for m in modules]
        states = [getattr(b.weight, "quant_state", None) for b in bases]
        if any(s is None or s.quant_type != "nf4" or s.blocksize != states[0].blocksize for s in states):
            return None
        shapes = [tuple(s.shape) for s in states]
        rows, columns = sum(n for n, _ in shapes), shapes[0][1]
        if any(k != columns for _, k in shapes) or columns % states[0].blocksize or rows % 32 or columns % 2:
            return None
        absmax = [
            (dequantize_blockwise(s.absmax, s.state2) + s.offset).float() if s.nested else s.absmax.float()
            for s in states
        ]
        data = torch.cat([b.weight.data.reshape(-1).view(torch.uint8) for b in bases])
        state = QuantState(
            absmax=torch.cat(absmax),
            shape=torch.Size((rows, columns)),
            code=states[0].code,
            blocksize=states[0].blocksize,
            quant_type="nf4",
            dtype=torch.bfloat16,
        )
        packed, state = _convert_weight_packed_for_cpu(data, state)
        biases = [b.bias for b in bases]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(n) for b, (n, _) in zip(biases, shapes)])
            bias = bias.detach().to(torch.bfloat16)
        return cls(packed, state, bias)

    def set_lora(self, modules: list[nn.Module]) -> bool:
        """Take the layers' current LoRA (none when their adapter is off); False where one is not a plain
        LoRA this step can run (dropout, a variant, a bias, several adapters, different scales)."""
        parts = []
        for module in modules:
            adapter = _plain_lora(module)
            if adapter is False:
                return False
            parts.append(adapter)
        if all(p is None for p in parts):
            self.lora = None
            return True
        if any(p is None for p in parts) or len({scale for _, _, scale in parts}) != 1:
            return False
        a = torch.cat([a for a, _, _ in parts])
        b = torch.block_diag(*(b for _, b, _ in parts))
        self.lora = (a.detach(), b.detach(), parts[0][2])
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        x16 = x.to(torch.bfloat16).contiguous()
        if self._kernel is not None:  # the library's C kernel itself: its Python wrapper costs more than the matmul
            rows, columns, packed, absmax = self._fixed
            out = x16.new_empty((x16.shape[0], state.shape[0]))
            self._kernel(
                ctypes.c_int64(x16.shape[0]),
                rows,
                columns,
                ctypes.c_void_p(x16.data_ptr()),
                packed,
                absmax,
                ctypes.c_void_p(out.data_ptr()),
                ctypes.c_int64(state.blocksize),
                ctypes.c_int64(x16.stride(0)),
                ctypes.c_int64(out.stride(0)),
            )
        else:
            out = torch.ops.bitsandbytes.gemv_4bit.default(
                x16, self.packed, state.shape, state.absmax, state.code, state.blocksize
            )
        if self.bias is not None:
            out = out + self.bias
        out = out.to(x.dtype)
        if self.lora is not None:  # out + scale * (x @ A.T) @ B.T, the scaling and the sum inside one product
            a, b, scale = self.lora
            down = x.to(a.dtype) @ a.t()
            if out.dtype == a.dtype:
                return torch.addmm(out, down, b.t(), alpha=scale)
            out = out + (down @ b.t()) * scale
        return out


def _nf4_kernel() -> Any:
    """bitsandbytes' CPU NF4 x bf16 kernel, as its ``gemv_4bit`` op calls it (None where its library lacks it)."""
    try:
        from bitsandbytes.cextension import lib
    except ImportError:
        return None
    return getattr(lib, "gemv_4bit_inference_cpu_nf4_bf16", None)


def _base_layer(module: nn.Module) -> nn.Module:
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def _plain_lora(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None | bool:
    """(A, B, scale) of ``module``'s one active plain LoRA; None without an active one; False for anything
    else (a variant such as DoRA, a LoRA bias, several adapters)."""
    if not hasattr(module, "lora_A") or module.disable_adapters or module.merged:
        return None
    active = [name for name in module.active_adapters if name in module.lora_A]
    if not active:
        return None
    if len(active) != 1 or getattr(module, "fan_in_fan_out", False):
        return False
    (name,) = active  # dropout does not apply: sampling is inference (the merged weights leave it out too)
    if name in getattr(module, "lora_variant", {}) or module.lora_B[name].bias is not None:
        return False
    return module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]


class LlamaDecodeStep:
    """``step(tokens, positions, mask, cache) -> logits``: one token per row through ``sampler``
    (a ``MergedSampler``). ``mask`` [B, T] covers the cache plus the new token. A step of at most
    ``quantized_rows`` rows runs the NF4 base plus the LoRA (``Nf4Projection``) where the sampler
    computes in bf16 on a CPU and its base is NF4; elsewhere, and for more rows, the dense weights."""

    def __init__(self, sampler: MergedSampler, quantized_rows: int = 0):
        self.sampler = sampler
        self._first: nn.Module | None = None  # the q projection the stacks were built from
        self._layers: list[tuple] = []
        self.quantized_rows = quantized_rows if _nf4_applies(sampler) else 0
        self._nf4: list[tuple[Nf4Projection, ...]] | None = None  # per layer: qkv, o, gate_up, down
        self._nf4_lora: tuple | None = None  # the sampler's fingerprint the LoRA parts were taken at

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

    def _prepare_nf4(self) -> list[tuple[Nf4Projection, ...]] | None:
        """The NF4 projections (built once), with the LoRA as the sampler's merge last saw it; None (and
        the dense path from then on) where a layer cannot run so."""
        source = self.sampler.source.model.layers
        groups = [
            [
                [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                [layer.self_attn.o_proj],
                [layer.mlp.gate_proj, layer.mlp.up_proj],
                [layer.mlp.down_proj],
            ]
            for layer in source
        ]
        if self._nf4 is None:
            built = [tuple(Nf4Projection.build(g) for g in layer) for layer in groups]
            if any(p is None for layer in built for p in layer):
                self.quantized_rows = 0
                return None
            self._nf4 = built
        fingerprint = self.sampler._fingerprint
        if self._nf4_lora != fingerprint:
            for projections, layer in zip(self._nf4, groups):
                for projection, modules in zip(projections, layer):
                    if not projection.set_lora(modules if self.sampler.lora else []):
                        self.quantized_rows = 0
                        return None
            self._nf4_lora = fingerprint
        return self._nf4

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        model = self.sampler.model()
        self._prepare(model)
        nf4 = self._prepare_nf4() if 0 < tokens.shape[0] <= self.quantized_rows else None
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
            if nf4 is not None:
                x = self._nf4_layer(x, index, nf4[index], norm1, norm2, cos, sin, attend, cache)
                continue
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
        return self._head(model, x)

    def _nf4_layer(self, x, index, projections, norm1, norm2, cos, sin, attend, cache) -> torch.Tensor:
        """One decoder layer through the NF4 projections: the dense path's arithmetic otherwise."""
        qkv_proj, o_proj, gate_up, down = projections
        config = self.sampler.source.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rows, q_size, kv_size = x.shape[0], heads * head_dim, kv_heads * head_dim
        q, k, v = qkv_proj(_rms_norm(x, norm1)).split((q_size, kv_size, kv_size), dim=-1)
        q = _rotate(q.reshape(rows, heads, head_dim), cos, sin)
        k = _rotate(k.reshape(rows, kv_heads, head_dim), cos, sin)
        keys, values = cache.update(k[:, :, None, :], v.reshape(rows, kv_heads, 1, head_dim), index)
        out = F.scaled_dot_product_attention(
            q.view(rows, kv_heads, heads // kv_heads, head_dim), keys, values, attn_mask=attend, scale=head_dim**-0.5
        )
        x = x + o_proj(out.reshape(rows, q_size))
        gate, up = gate_up(_rms_norm(x, norm2)).chunk(2, dim=-1)
        return x + down(F.silu(gate) * up)

    @staticmethod
    def _head(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        head = model.lm_head
        if type(head) is nn.Linear and not (head._forward_hooks or head._forward_pre_hooks):
            return _linear(x, head.weight, head.bias, row_major=True).float().cpu()  # [B, V]
        return head(x).float().cpu()  # a LoRA head, or hooks on it (tests force tokens with one): the module itself


def _nf4_applies(sampler: MergedSampler) -> bool:
    """Whether the NF4 path may run: a bf16 sampler on a CPU whose bitsandbytes has its 4-bit CPU kernel."""
    if sampler.compute_dtype != torch.bfloat16 or next(sampler.source.parameters()).device.type != "cpu":
        return False
    try:
        import bitsandbytes.backends.cpu.ops  # noqa: F401  registers the CPU kernels
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16()) and hasattr(torch.ops.bitsandbytes, "gemv_4bit")


def decode_step(sampler: MergedSampler | None, quantized_rows: int = 0) -> LlamaDecodeStep | None:
    """The lean decode step for ``sampler``'s model, or None where it does not apply. Looks at
    the model's structure only: the merge itself still happens at the first forward pass.
    ``quantized_rows``: steps of at most this many rows read the NF4 base (``LlamaDecodeStep``)."""
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
    return LlamaDecodeStep(sampler, quantized_rows)
