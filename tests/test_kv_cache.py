"""The append-in-place KV cache returns exactly what transformers' concatenating cache returns."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from agl.kv_cache import AppendInPlaceLayer

ops = st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 70)), st.tuples(st.just("replace_rows"), st.integers(1, 3))), min_size=1, max_size=25)


@given(ops)
@settings(max_examples=60, deadline=None)
def test_same_keys_and_values_as_the_concatenating_layer(operations):
    reference, layer = DynamicLayer(), AppendInPlaceLayer()
    gen = torch.Generator().manual_seed(0)
    for op, n in operations:
        if op == "append":
            k = torch.randn(3, 2, n, 4, generator=gen)
            v = torch.randn(3, 2, n, 4, generator=gen)
            expected = reference.update(k, v)
            got = layer.update(k, v)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        elif reference.get_seq_length():  # the engine swaps in new tensors (merge / retire)
            keep = torch.tensor([0, 2, 1])
            reference.keys, reference.values = reference.keys[keep], reference.values[keep]
            layer.keys, layer.values = layer.keys[keep], layer.values[keep]
    assert layer.get_seq_length() == reference.get_seq_length()


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_appending_one_token_writes_in_place(mode):
    """The engine decodes under inference_mode, where views forget their base tensor; the
    layer must still append into its buffer rather than copy the cache on every token."""
    layer = AppendInPlaceLayer()
    with mode():
        layer.update(torch.randn(1, 1, 10, 4), torch.randn(1, 1, 10, 4))
        buffer = layer.buffers[0].data_ptr()
        for length in range(11, 40):
            layer.update(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
            assert layer.keys.data_ptr() == buffer and layer.keys.shape[-2] == length
