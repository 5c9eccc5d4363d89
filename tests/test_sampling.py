"""Inverse-CDF token draws: the right distribution, never a zero-probability token."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.policy.engine import _top_p_filter, draw


@given(
    probs=st.lists(st.one_of(st.just(0.0), st.floats(1e-12, 1.0)), min_size=1, max_size=30).filter(
        lambda p: sum(p) > 0
    ),
    u=st.one_of(st.just(0.0), st.floats(0.0, 1.0, exclude_max=True), st.just(1.0 - 2**-53)),
)
@settings(max_examples=300, deadline=None)
def test_a_draw_is_always_a_token_with_positive_probability(probs, u):
    token = int(draw(torch.tensor([probs], dtype=torch.float32), torch.tensor([u], dtype=torch.float64))[0])
    assert 0 <= token < len(probs) and probs[token] > 0


def test_frequencies_follow_the_probabilities():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(50, generator=gen) * 2, dim=0)
    n = 40_000
    tokens = draw(probs.expand(n, -1), torch.rand(n, generator=gen, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=50).double() / n
    # 5 standard errors of a binomial proportion, per token
    tolerance = 5 * (probs.double() * (1 - probs.double()) / n).sqrt() + 1e-4
    assert ((freq - probs.double()).abs() <= tolerance).all()


def test_unnormalized_rows_are_sampled_by_their_own_mass():
    # a top-p filtered row no longer sums to 1: [0.3, 0, 0.3] means half and half
    tokens = draw(torch.tensor([[0.3, 0.0, 0.3]] * 4), torch.tensor([0.0, 0.49, 0.51, 0.999], dtype=torch.float64))
    assert tokens.tolist() == [0, 0, 2, 2]


@given(
    top_p=st.one_of(st.just(5e-324), st.just(1e-45), st.floats(0.0, 1.0, exclude_min=True)),
    logits=st.lists(st.floats(-20, 20), min_size=1, max_size=30),
)
@settings(max_examples=200, deadline=None)
def test_a_nucleus_always_holds_the_most_likely_token(top_p, logits):
    """top_p=5e-324 is 0 in float32: the filter kept no token, and the draw went past the vocabulary. Among tied
    most likely tokens the sort's order decides which one the nucleus holds, so the check is "one of them"."""
    probs = torch.softmax(torch.tensor([logits]), dim=-1)
    kept = _top_p_filter(probs, torch.tensor([top_p]))
    assert (kept[0][probs[0] == probs[0].max()] > 0).any()
    token = int(draw(kept, torch.tensor([0.5], dtype=torch.float64))[0])
    assert 0 <= token < len(logits) and kept[0, token] > 0
