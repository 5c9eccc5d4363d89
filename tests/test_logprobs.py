"""The fused token log-prob op equals the plain tensor-op computation, in value and gradient."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from agl.train.logprobs import token_logprobs


def reference(hidden, weight, tokens, temperature):
    logits = (hidden @ weight.t()) / temperature[:, None]
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(1, tokens[:, None])[:, 0], entropy.detach()


@given(
    n=st.integers(1, 9),
    hidden_size=st.integers(1, 12),
    vocab=st.integers(2, 40),
    seed=st.integers(0, 2**16),
    temperature=st.floats(0.2, 2.0),
    scale=st.floats(0.1, 20.0),
)
@example(
    n=3, hidden_size=3, vocab=38, seed=3, temperature=0.201171875, scale=5.0
)  # failed when the op ran fp64 inputs in fp32
@settings(max_examples=80, deadline=None)
def test_value_entropy_and_gradients_match_the_plain_computation(
    device, n, hidden_size, vocab, seed, temperature, scale
):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=gen, dtype=torch.float64) * scale
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    temps = torch.full((n,), temperature, dtype=torch.float64) * torch.rand(n, generator=gen, dtype=torch.float64).add(
        0.5
    )
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)
    hidden, weight, tokens, temps, upstream = (t.to(device) for t in (hidden, weight, tokens, temps, upstream))

    results = []
    for fn in (token_logprobs, reference):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = fn(h, w, tokens, temps)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, h.grad, w.grad))
    for got, expected in zip(*results):
        assert got.device.type == torch.device(device).type  # computed where its inputs are
        torch.testing.assert_close(got.double(), expected.double(), atol=1e-4, rtol=1e-4)


def test_gradient_only_flows_to_what_requires_it():
    hidden = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(7, 4)  # a frozen output layer, as with LoRA
    logp, entropy = token_logprobs(hidden, weight, torch.tensor([0, 6, 2]), torch.ones(3))
    assert not entropy.requires_grad
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_a_second_backward_through_the_same_graph_is_refused():
    hidden = torch.randn(2, 4, requires_grad=True)
    logp, _ = token_logprobs(hidden, torch.randn(5, 4), torch.tensor([1, 2]), torch.ones(2))
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        logp.sum().backward()


def test_the_forward_in_blocks_of_rows_gives_what_one_block_gives(monkeypatch, device):
    """The forward's logits are made a block of rows at a time (agl.train.logprobs.CHUNK_BYTES): the same
    log-probs, entropies and gradients as all rows at once, here in blocks of 3 rows and a last of 1."""
    import agl.train.logprobs

    torch.manual_seed(5)
    hidden, weight = torch.randn(10, 16, device=device), torch.randn(50, 16, device=device)
    tokens, temperature = torch.randint(0, 50, (10,), device=device), torch.rand(10, device=device) + 0.5

    def run():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = token_logprobs(h, w, tokens, temperature)
        (logp * torch.arange(10, device=device)).sum().backward()
        return logp.detach(), entropy, h.grad, w.grad

    whole = run()
    monkeypatch.setattr(agl.train.logprobs, "CHUNK_BYTES", 3 * 50 * 4)
    blocks = run()
    for a, b in zip(blocks, whole):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # BLAS may sum a block of rows in another order


@given(n=st.integers(1, 7), vocab=st.integers(2, 70), seed=st.integers(0, 2**16), blocks=st.booleans())
@settings(max_examples=40, deadline=None)
def test_grammar_masked_rows_equal_the_log_softmax_of_masked_logits(n, vocab, seed, blocks):
    """Rows with a grammar mask (agl.policy.grammar) get the masked distribution's log-prob, entropy
    and gradient; rows without one are untouched; in one block of rows or several."""
    import agl.train.logprobs

    chunk = agl.train.logprobs.CHUNK_BYTES
    agl.train.logprobs.CHUNK_BYTES = 2 * vocab * 8 if blocks else chunk
    try:
        check_masked_rows(n, vocab, seed)
    finally:
        agl.train.logprobs.CHUNK_BYTES = chunk


def check_masked_rows(n, vocab, seed):
    from agl.policy.grammar import mask_bias

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 6, generator=gen, dtype=torch.float64) * 3
    weight = torch.randn(vocab, 6, generator=gen, dtype=torch.float64)
    temps = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
    bitmask = torch.randint(-(2**31), 2**31 - 1, (n, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    allowed = mask_bias(bitmask, vocab) == 0
    allowed[torch.arange(n), torch.randint(0, vocab, (n,), generator=gen)] = True  # at least one token each
    bitmask = torch.zeros_like(bitmask)  # rebuilt from `allowed`, bit t of word t // 32
    for row, token in allowed.nonzero().tolist():
        bitmask[row, token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    tokens = torch.multinomial(allowed.double(), 1, generator=gen)[:, 0]  # sampled under the mask
    index = torch.where(torch.rand(n, generator=gen) < 0.6, torch.arange(n), torch.full((n,), -1))
    upstream = torch.randn(n, generator=gen, dtype=torch.float64)

    def masked_reference(h, w, tokens, temps):
        logits = (h @ w.t()) / temps[:, None]
        logits = torch.where((index[:, None] >= 0) & ~allowed, float("-inf"), logits)
        log_probs = torch.log_softmax(logits, dim=-1)
        entropy = -(log_probs.exp() * log_probs.clamp(min=-1e300)).sum(-1)
        return log_probs.gather(1, tokens[:, None])[:, 0], entropy.detach()

    results = []
    for fn in (lambda *a: token_logprobs(*a, index, bitmask), masked_reference):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, entropy = fn(h, w, tokens, temps)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, h.grad, w.grad))
    for got, expected in zip(*results):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), expected.double(), atol=1e-6, rtol=1e-6)
