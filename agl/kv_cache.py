"""A KV cache that appends in place: decode steps stop copying the whole cache.

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every token, so decoding T tokens
copies O(T^2) cache bytes: ~35 ms per batch-32 decode step here. This layer keeps
its keys/values as views into buffers with spare room, so appending one token writes one
column. The engine may still replace ``keys``/``values`` wholesale (merging new rows in,
dropping finished ones); the next update notices and re-buffers them.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class AppendInPlaceLayer(DynamicLayer):
    growth = 1.5
    slack = 64

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.buffers: list[torch.Tensor | None] = [None, None]  # keys', values' storage with room to grow

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append(0, self.keys, key_states)
        self.values = self._append(1, self.values, value_states)
        return self.keys, self.values

    def _append(self, which: int, cached: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write ``new`` after ``cached`` in its buffer; re-buffer when ``cached`` is not the
        buffer's filled view any more (replaced by the engine) or the buffer is full.

        The buffer is kept explicitly: under ``torch.inference_mode`` views do not record
        their ``_base``, so a view cannot tell which buffer it came from.
        """
        buffer = self.buffers[which]
        if cached.numel() == 0:  # the first update: lazy_initialization left an empty 1-d tensor
            cached = new[..., :0, :]
        length, added = cached.shape[-2], new.shape[-2]
        fits = (
            buffer is not None
            and cached.data_ptr() == buffer.data_ptr()
            and cached.shape[:-2] == buffer.shape[:-2]
            and cached.stride() == buffer.stride()
            and buffer.shape[-2] >= length + added
        )
        if not fits:
            states = torch.cat([cached, new], dim=-2) if length else new
            length, added = 0, states.shape[-2]
            capacity = int(added * self.growth) + self.slack
            buffer = self.buffers[which] = states.new_empty((*states.shape[:-2], capacity, states.shape[-1]))
            new = states
        buffer[..., length : length + added, :] = new
        return buffer[..., : length + added, :]


def append_in_place_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = AppendInPlaceLayer
    return cache


def cache_from_tensors(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A new append-in-place cache holding (a copy of) each layer's ``(keys, values)``."""
    cache = append_in_place_cache()
    for keys, values in tensors:
        layer = AppendInPlaceLayer()
        layer.update(keys, values)
        cache.layers.append(layer)
    return cache
