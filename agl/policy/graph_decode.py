"""The decode step in static shapes, replayed as a CUDA graph on a GPU (``engine.decode=graph``).

On a GPU an eager decode step is bound by the host: every one of its ~2,000 operators costs a dispatch and a
kernel launch whatever the batch (docs/gpu.md, "Measured on an H200"). A CUDA graph records the step's kernels
once and replays them with one launch. A graph replays fixed shapes at fixed addresses, so this step is written
for that:

  - rows are padded to a bucket (the next power of two, at most the cache's row slots) and the cache's
    columns to another (the next power of two from 64, at most the buffer's); one graph per (buffers, rows,
    columns), captured the first time it is met, and dropped when the sampler's weights are merged again;
  - the KV cache is the engine's slot cache (agl.policy.kv_cache) with room made up front (``min_rows``,
    ``min_columns``: its buffers are rarely replaced); the new token's keys and values are written in place at
    the live part's end column, an index held in a tensor (``index_copy_``);
  - every row attends over the bucket's columns under its mask (columns before its first real one, or past the
    end, are masked out), so the shapes do not depend on the live width;
  - inputs (tokens, positions, mask, the end column) are copied into the graph's own tensors before a replay,
    and the logits come out of its output tensor, on the device: the engine samples there
    (``Engine._sample`` runs on the logits' device) and copies a token and a log-prob per row to the host.

On a CPU (and wherever ``capture`` is off) the same static step runs eagerly: tests/test_graph_decode.py shows it
gives the tokens of agl.policy.decode's step. The captured path is tested on the CUDA lane.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from agl.policy.decode import LlamaDecodeStep, _linear, _rms_norm, _rotate, decode_step

if TYPE_CHECKING:
    from agl.policy.sampler_weights import MergedSampler

MIN_COLUMNS = 64


def bucket(n: int, cap: int, floor: int = 1) -> int:
    """The next power of two from ``n`` (at least ``floor``), at most ``cap``.

    >>> [bucket(n, 48) for n in (1, 3, 8, 9, 40)]
    [1, 4, 8, 16, 48]
    """
    size = max(floor, 1 << (max(n, 1) - 1).bit_length())
    return min(size, cap)


class _Graph:
    """One captured step: its input and output tensors and the graph (None: run eagerly)."""

    def __init__(self, rows: int, columns: int, device: torch.device):
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, columns, dtype=torch.bool, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: Any = None


class GraphDecodeStep(LlamaDecodeStep):
    """``step(tokens, positions, mask, cache) -> logits`` (on the model's device) in static shapes; on CUDA
    (``capture`` None or True) each shape is captured once as a CUDA graph and replayed."""

    max_graphs = 32  # captured shapes kept (the oldest dropped first)

    def __init__(self, sampler: MergedSampler, capture: bool | None = None):
        super().__init__(sampler)
        self.capture = capture
        self._graphs: dict[tuple, _Graph] = {}
        self._weights_of: Any = None  # the merge the graphs were captured with

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        model = self.sampler.model()
        self._prepare(model)
        if self._weights_of is not self._first:  # a new merge: new weight tensors, so new graphs
            self._graphs.clear()
            self._weights_of = self._first
        layers = cache.layers
        for layer in layers:
            layer.reserve(1)
        first = layers[0]
        keys = first.buffers[0]
        slots, capacity = keys.shape[0], keys.shape[-2]
        rows, device = tokens.shape[0], keys.device
        padded_rows = bucket(rows, slots)
        columns = bucket(first.end + 1, capacity, MIN_COLUMNS)
        capture = self.capture if self.capture is not None else device.type == "cuda"
        key = (keys.data_ptr(), padded_rows, columns)
        graph = self._graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = _Graph(padded_rows, columns, device)
        self._fill(graph, tokens, positions, mask, first.start, first.end)
        if not capture:
            graph.logits = self._run(model, cache, graph)
        elif fresh:
            self._capture(model, cache, graph)
            graph.graph.replay()
        else:
            graph.graph.replay()
        if fresh and capture:
            if len(self._graphs) >= self.max_graphs:
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = graph
        for layer in layers:  # the host's bookkeeping of what the step wrote
            layer.end += 1
            layer._publish()
        return graph.logits[:rows].clone()

    @staticmethod
    def _fill(graph: _Graph, tokens, positions, mask, start: int, end: int) -> None:
        """Copy a step's inputs into the graph's tensors: real rows first, padding rows after them (token 0,
        position 0, attending to the new column only)."""
        rows, width = mask.shape  # width: the live columns plus the new one
        graph.tokens.zero_()
        graph.tokens[:rows].copy_(tokens, non_blocking=True)
        graph.positions.zero_()
        graph.positions[:rows].copy_(positions, non_blocking=True)
        graph.mask.zero_()
        graph.mask[:rows, start : start + width].copy_(mask.bool(), non_blocking=True)
        graph.mask[rows:, end] = True
        graph.column.fill_(end)

    def _capture(self, model: Any, cache: Any, graph: _Graph) -> None:
        """Warm up on a side stream, then record the step (it writes only where the replay that follows
        writes the same values: the inputs are the real step's). Each graph has its own memory pool: graphs of
        different shapes replay in any order."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(model, cache, graph)
        torch.cuda.current_stream().wait_stream(stream)
        graph.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph.graph):
            graph.logits = self._run(model, cache, graph)

    def _run(self, model: Any, cache: Any, graph: _Graph) -> torch.Tensor:
        """The step on the graph's tensors: agl.policy.decode's arithmetic over the buffers' first rows and columns."""
        config = model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        group = heads // kv_heads
        rows, columns = graph.mask.shape
        rotary = model.model.rotary_emb
        x = model.model.embed_tokens(graph.tokens)
        freqs = graph.positions[:, None].float() * rotary.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * rotary.attention_scaling).to(x.dtype)[:, None, :]
        sin = (angles.sin() * rotary.attention_scaling).to(x.dtype)[:, None, :]
        attend = graph.mask[:, None, None, :]
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        for index, (norm1, (w_qkv, b_qkv), o_proj, norm2, (w_gu, b_gu), down) in enumerate(self._layers):
            qkv = _linear(_rms_norm(x, norm1), w_qkv, b_qkv, row_major=True)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = _rotate(q.view(rows, heads, head_dim), cos, sin)
            k = _rotate(k.view(rows, kv_heads, head_dim), cos, sin)
            key_buffer, value_buffer = cache.layers[index].buffers
            key_buffer[:rows].index_copy_(2, graph.column, k[:, :, None, :].to(key_buffer.dtype))
            value_buffer[:rows].index_copy_(
                2, graph.column, v.reshape(rows, kv_heads, 1, head_dim).to(value_buffer.dtype)
            )
            out = F.scaled_dot_product_attention(
                q.view(rows, kv_heads, group, head_dim),
                key_buffer[:rows, :, :columns],
                value_buffer[:rows, :, :columns],
                attn_mask=attend,
                scale=head_dim**-0.5,
            )
            x = x + _linear(out.reshape(rows, q_size), o_proj.weight, o_proj.bias)
            gate, up = _linear(_rms_norm(x, norm2), w_gu, b_gu).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, down.weight, down.bias)
        x = model.model.norm(x)
        head = model.lm_head
        if type(head) is torch.nn.Linear and not (head._forward_hooks or head._forward_pre_hooks):
            return _linear(x, head.weight, head.bias, row_major=True).float()
        return head(x).float()


def graph_decode_step(sampler: MergedSampler | None, capture: bool | None = None) -> GraphDecodeStep | None:
    """The static-shape step for ``sampler``'s model where agl.policy.decode's step applies, else None."""
    if decode_step(sampler) is None:
        return None
    return GraphDecodeStep(sampler, capture)
