"""The engine's KV cache: rows as slots in buffers with room to grow, so appending a token,
retiring a row and admitting one copy only what changes.

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every token, so decoding T tokens copies O(T^2) cache
bytes (docs/benchmarks-history.md#kv-cache-slots). A ``SlotLayer`` keeps each layer's keys and values in two
buffers ``[row slots, kv_heads, columns, head_dim]`` and exposes the live part, rows ``[:rows]`` and columns
``[start:end]``, as views:

  - appending writes one column (``update``);
  - retiring rows moves the last live rows into the freed slots, one row each, and drops
    leading columns no live row uses by moving ``start`` (``keep_rows``);
  - admitting rows writes them into free slots, right-aligned at ``end`` (``add_rows``).

Only when the buffer runs out of rows or columns is the live part copied into a new one, layer by layer (so the
transient is one layer's): exactly the row slots needed, and the columns needed plus ``slack``. Appending then
compacts the live part to column 0 every ``slack`` tokens, a copy of the cache per 64 decode steps. Headroom is
what costs memory, not copies, so it is kept small. Before slots, every retired or admitted row cost two or three
copies of the whole cache.

Positions outside a row's real tokens hold zeros or an earlier row's keys and values; the
engine's attention mask hides them. Buffers start zeroed so that no hidden position is NaN (a
masked NaN value would still poison ``0 * v`` in the attention's weighted sum).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlotLayer(DynamicLayer):
    slack = 64  # spare columns in a new buffer

    def __init__(self, min_rows: int = 0, min_columns: int = 0, **kwargs):
        """``min_rows``/``min_columns``: a new buffer has at least these row slots and columns, and
        columns grow to twice the live width (agl.policy.graph_decode: a CUDA graph is captured on
        the buffers, so they should rarely be replaced). 0: exactly the rows needed, width + ``slack``."""
        super().__init__(**kwargs)
        self.min_rows, self.min_columns = min_rows, min_columns
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, values) storage
        self.rows = self.start = self.end = 0  # the live part: rows [:rows], columns [start:end]
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # what keys/values were last set to

    # -- transformers' layer interface
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` [rows, kv_heads, added, head_dim] after the live columns."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._adopt_replaced()
        if self.buffers is None:
            self._load(key_states, value_states)
            return self._publish()
        if key_states.shape[0] != self.rows:
            raise ValueError(f"{key_states.shape[0]} rows appended to a cache of {self.rows}")
        added = key_states.shape[-2]
        self.reserve(added)
        for buffer, states in zip(self.buffers, (key_states, value_states)):
            buffer[: self.rows, :, self.end : self.end + added] = states
        self.end += added
        return self._publish()

    def reset(self) -> None:
        self.buffers, self._views = None, None
        self.rows = self.start = self.end = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (transformers' convention: a negative count)."""
        self._adopt_replaced()
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of columns to remove, not {tokens_to_remove}")
        if self.buffers is not None and tokens_to_remove:
            self.end = max(self.start, self.end + tokens_to_remove)
            self._publish()

    def reserve(self, added: int) -> None:
        """Room for ``added`` more columns after the live ones: out of columns, the live part is
        compacted to column 0 of a new buffer with room."""
        if self.end + added > self.buffers[0].shape[-2]:
            self._rebuffer(self.buffers[0].shape[0], self._columns_for(self.end - self.start + added), offset=0)

    # -- the engine's row operations
    def keep_rows(self, moves: list[tuple[int, int]], rows: int, drop_columns: int = 0) -> None:
        """Shrink to ``rows`` live rows: row ``source`` is copied into slot ``target`` for each
        (source, target) in ``moves`` (sources at or past ``rows``, targets before it), then the
        first ``drop_columns`` live columns are dropped."""
        self._adopt_replaced()
        self.start = min(self.start + drop_columns, self.end)
        if moves:
            sources, targets = (torch.tensor(side) for side in zip(*moves))
            for buffer in self.buffers:
                buffer[targets, :, self.start : self.end] = buffer[sources, :, self.start : self.end]
        self.rows = rows
        self._publish()

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Admit ``keys``/``values`` [n, kv_heads, T, head_dim] as new rows after the live ones,
        their last column aligned with the live part's last; the live columns widen to T if
        that is more. Grows the buffer if it must, to exactly the rows now live."""
        self._adopt_replaced()
        added, columns = keys.shape[0], keys.shape[-2]
        width = max(self.end - self.start, columns)
        slots, capacity = self.buffers[0].shape[0], self.buffers[0].shape[-2]
        if self.rows + added > slots or self.end < width:
            offset = width - (self.end - self.start)  # room on the left for the new rows' longer prompts
            self._rebuffer(
                max(slots, self.rows + added, self.min_rows), max(capacity, self._columns_for(width)), offset
            )
        for buffer, states in zip(self.buffers, (keys, values)):
            buffer[self.rows : self.rows + added, :, self.end - columns : self.end] = states
        self.rows += added
        self.start = self.end - width
        self._publish()

    # -- storage
    def _columns_for(self, width: int) -> int:
        """The columns of a new buffer for a live part ``width`` wide."""
        if self.min_columns:
            return max(self.min_columns, 2 * width, width + self.slack)
        return width + self.slack

    def _load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Take ``keys``/``values`` [rows, kv_heads, T, head_dim] as the whole live part (a copy)."""
        rows, columns = keys.shape[0], keys.shape[-2]
        shape = (max(rows, self.min_rows), keys.shape[1], self._columns_for(columns), keys.shape[-1])
        self.buffers = (keys.new_zeros(shape), values.new_zeros(shape[:-1] + values.shape[-1:]))
        self.buffers[0][:rows, :, :columns] = keys
        self.buffers[1][:rows, :, :columns] = values
        self.rows, self.start, self.end = rows, 0, columns

    def _rebuffer(self, slots: int, capacity: int, offset: int) -> None:
        """Copy the live part into new buffers of ``slots`` rows and ``capacity`` columns, its first column at
        ``offset``."""
        width = self.end - self.start
        fresh = []
        for buffer in self.buffers:
            new = buffer.new_zeros((slots, buffer.shape[1], capacity, buffer.shape[-1]))
            new[: self.rows, :, offset : offset + width] = buffer[: self.rows, :, self.start : self.end]
            fresh.append(new)
        self.buffers = (fresh[0], fresh[1])
        self.start, self.end = offset, offset + width

    def _publish(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (buffer[: self.rows, :, self.start : self.end] for buffer in self.buffers)
        self.keys, self.values = self._views = keys, values
        return keys, values

    def _adopt_replaced(self) -> None:
        """Whoever set ``keys``/``values`` directly (transformers' ``batch_select_indices`` and
        kin) replaced the live part: take their tensors as it. (Offloading, which swaps tensors
        every layer, would reload every time; the engine does not offload.)"""
        if (
            self.buffers is not None
            and self.keys is not None
            and (self.keys is not self._views[0] or self.values is not self._views[1])
        ):
            self._load(self.keys, self.values)
            self._publish()


def slot_cache(min_rows: int = 0, min_columns: int = 0) -> DynamicCache:
    """An empty slot cache; ``min_rows``/``min_columns``: see ``SlotLayer``."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = (
        functools.partial(SlotLayer, min_rows=min_rows, min_columns=min_columns)
        if min_rows or min_columns
        else SlotLayer
    )
    return cache


def cache_from_tensors(
    tensors: list[tuple[torch.Tensor, torch.Tensor]], min_rows: int = 0, min_columns: int = 0
) -> DynamicCache:
    """A new slot cache holding (a copy of) each layer's ``(keys, values)``."""
    cache = slot_cache(min_rows, min_columns)
    for keys, values in tensors:
        layer = SlotLayer(min_rows=min_rows, min_columns=min_columns)
        layer.update(keys, values)
        cache.layers.append(layer)
    return cache


def slot_moves(keep: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """How to keep only rows ``keep`` (ascending) of a batch: the (source, target) row moves that
    fill freed slots with the last kept rows, and ``order``, the old row now in each slot.

    >>> slot_moves([0, 2, 4])
    ([(4, 1)], [0, 4, 2])
    """
    rows, kept = len(keep), set(keep)
    moves = list(zip([i for i in keep if i >= rows], [i for i in range(rows) if i not in kept]))
    order = list(range(rows))
    for source, target in moves:
        order[target] = source
    return moves, order


def keep_rows(cache: DynamicCache, moves: list[tuple[int, int]], rows: int, drop_columns: int = 0) -> None:
    """``SlotLayer.keep_rows`` on every layer."""
    for layer in cache.layers:
        layer.keep_rows(moves, rows, drop_columns)


def add_rows(cache: DynamicCache, new: DynamicCache) -> None:
    """``SlotLayer.add_rows`` on every layer, with ``new``'s layers as the rows to admit."""
    for layer, rows in zip(cache.layers, new.layers):
        layer.add_rows(rows.keys, rows.values)
