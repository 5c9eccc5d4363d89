"""The slot KV cache holds what a concatenating cache would, wherever a row has real tokens.

The reference is the engine's old arithmetic: every operation builds new tensors by
concatenation, left padding and indexing. A ``SlotLayer`` must expose the same live shape and
the same keys and values at every real (unpadded) position, whatever mix of appends, retired
rows, admitted rows and outside replacements came before.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.policy.kv_cache import SlotLayer, slot_moves

HEADS, DIM = 2, 3


def left_pad(tensor, width, dim):
    shape = list(tensor.shape)
    shape[dim] = width
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class Reference:
    """Keys as one tensor [rows, heads, T, dim] plus a mask [rows, T] of real positions."""

    def __init__(self, keys):
        self.keys, self.mask = keys, torch.ones(keys.shape[0], keys.shape[-2], dtype=torch.bool)

    def append(self, keys):
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.mask = torch.cat([self.mask, torch.ones(keys.shape[0], keys.shape[-2], dtype=torch.bool)], dim=1)

    def keep(self, order, drop):
        self.keys, self.mask = self.keys[order][..., drop:, :], self.mask[order][:, drop:]

    def add(self, keys):
        width = max(self.keys.shape[-2], keys.shape[-2])
        new_mask = torch.ones(keys.shape[0], keys.shape[-2], dtype=torch.bool)
        self.keys = torch.cat(
            [left_pad(self.keys, width - self.keys.shape[-2], -2), left_pad(keys, width - keys.shape[-2], -2)]
        )
        self.mask = torch.cat(
            [left_pad(self.mask, width - self.mask.shape[1], 1), left_pad(new_mask, width - keys.shape[-2], 1)]
        )


operation = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 70)),
    st.tuples(st.just("keep"), st.randoms(use_true_random=False)),
    st.tuples(st.just("add"), st.tuples(st.integers(1, 4), st.integers(1, 120))),
    st.tuples(st.just("select"), st.randoms(use_true_random=False)),  # transformers' batch_select_indices
)


@given(st.integers(1, 4), st.integers(1, 40), st.lists(operation, max_size=25))
@settings(max_examples=80, deadline=None)
def test_real_positions_match_the_concatenating_reference(rows, columns, operations):
    gen = torch.Generator().manual_seed(0)

    def states(n, t):
        return torch.randn(n, HEADS, t, DIM, generator=gen)

    first = states(rows, columns)
    layer, reference = SlotLayer(), Reference(first)
    layer.update(first, first + 1)
    for op, arg in operations:
        rows = reference.keys.shape[0]
        if op == "append":
            new = states(rows, arg)
            layer.update(new, new + 1)
            reference.append(new)
        elif op == "keep" and rows > 1:
            keep = sorted(arg.sample(range(rows), arg.randint(1, rows - 1)))
            moves, order = slot_moves(keep)
            assert sorted(order) == keep and all(order[t] == src for src, t in moves)
            assert all(order[i] == i for i in range(len(keep)) if i in keep)  # a kept row before the end stays put
            drop = int((reference.mask[order].any(0)).nonzero()[0])
            layer.keep_rows(moves, len(keep), drop)
            reference.keep(order, drop)
        elif op == "add":
            new = states(*arg)
            layer.add_rows(new, new + 1)
            reference.add(new)
        elif op == "select":
            index = torch.tensor(arg.sample(range(rows), rows))
            layer.batch_select_indices(index)
            reference.keep(index, 0)
        real = reference.mask[:, None, :, None].expand_as(reference.keys)
        assert layer.keys.shape == reference.keys.shape
        assert torch.equal(layer.keys[real], reference.keys[real])
        assert torch.equal(layer.values[real], reference.keys[real] + 1)
        assert (
            layer.keys.isfinite().all() and layer.values.isfinite().all()
        )  # hidden positions never uninitialized memory
        assert layer.get_seq_length() == reference.keys.shape[-2]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_appending_one_token_writes_in_place(mode):
    """The engine decodes under inference_mode, where views forget their base tensor; the
    layer must still append into its buffer rather than copy the cache on every token."""
    layer = SlotLayer()
    with mode():
        layer.update(torch.randn(1, 1, 10, 4), torch.randn(1, 1, 10, 4))
        buffer = layer.buffers[0].data_ptr()
        for length in range(11, 40):
            layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
            assert layer.keys.data_ptr() == buffer and layer.keys.shape[-2] == length


def test_retiring_and_admitting_rows_reuses_the_buffer():
    """A row retired and a shorter prompt admitted into its slot copy one row each, in place."""
    layer = SlotLayer()
    with torch.inference_mode():
        layer.update(torch.randn(4, 1, 30, 4), torch.randn(4, 1, 30, 4))
        buffer = layer.buffers[0].data_ptr()
        layer.keep_rows([(3, 1)], rows=3)
        layer.add_rows(torch.randn(1, 1, 20, 4), torch.randn(1, 1, 20, 4))
        layer.update(torch.randn(4, 1, 1, 4), torch.randn(4, 1, 1, 4))
        assert layer.buffers[0].data_ptr() == buffer and layer.keys.shape == (4, 1, 31, 4)


def test_a_reset_layer_starts_over():
    layer = SlotLayer()
    layer.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    layer.reset()
    keys = torch.randn(3, 1, 5, 4)
    assert torch.equal(layer.update(keys, keys)[0], keys)


def test_appending_a_wrong_number_of_rows_is_an_error():
    layer = SlotLayer()
    layer.update(torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4))
    with pytest.raises(ValueError, match="3 rows appended to a cache of 2"):
        layer.update(torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))


def test_a_grown_buffer_has_only_the_rows_live_and_slack_columns():
    """Headroom is what costs memory: a buffer regrown for one more row holds that row, not twice the slots."""
    layer = SlotLayer()
    layer.update(torch.randn(4, 1, 30, 4), torch.randn(4, 1, 30, 4))
    assert layer.buffers[0].shape == (4, 1, 30 + SlotLayer.slack, 4)
    layer.add_rows(torch.randn(1, 1, 40, 4), torch.randn(1, 1, 40, 4))
    assert layer.buffers[0].shape == (5, 1, 40 + SlotLayer.slack, 4) and layer.keys.shape == (5, 1, 40, 4)
