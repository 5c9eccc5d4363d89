"""Token log-probs (and entropy) straight from hidden states, in one fused autograd op.

The trainer needs, per completion token, ``log softmax(h @ W.T / temperature)[token]``, and the entropy of that
distribution as a metric. Written as separate tensor ops (divide, logsumexp, gather, log_softmax for the entropy,
and autograd's own backward of each), that is ~16 passes over a fresh [tokens, vocab] fp32 tensor: with a 49k
vocabulary and 1,024 tokens, 200 MB each (docs/benchmarks-history.md#fused-logprob-head). Here the forward makes
the logits once and turns them into probabilities in place; backward reuses those probabilities as the gradient
buffer (d logp[token] / d logits = onehot - p). About half the passes, one [N, V] tensor kept between forward and
backward, and the forward's other [N, V] work done in blocks of rows.

Worked example (one token, vocabulary of 2, temperature 1): logits [0, ln 3] give
p = [1/4, 3/4]; for token 1, logp = ln(3/4), entropy = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562.

Grammar-sampled positions (agl.policy.grammar) get the sampler's mask: -inf added to the scaled
logits of the tokens their grammar did not allow, before the log-softmax, so log p is the masked
distribution's. Their p is 0 there, so the backward (onehot - p) needs nothing else.
"""

from __future__ import annotations

import torch

from agl.policy.grammar import mask_bias

CHUNK_BYTES = 64 << 20  # the forward's transient logits, per block of rows


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, tokens_N, inv_temperature_N, grammar_index_N, bitmask_MW):
        dtype = torch.promote_types(hidden_NH.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        (N, _), V = hidden_NH.shape, weight_VH.shape[0]
        weight_HV = weight_VH.to(dtype).t()
        # Block by block of rows: each block's logits become log p in place, then p is written into
        # the one [N, V] buffer kept for backward. Whole, the logits, logsumexp's own temporary and
        # the probabilities were three [N, V] tensors at once (1.2 GB for a 2,048-token micro-batch).
        probs_NV = hidden_NH.new_empty((N, V), dtype=dtype)
        token_logp_N, entropy_N = hidden_NH.new_empty(N, dtype=dtype), hidden_NH.new_empty(N, dtype=dtype)
        rows = max(1, CHUNK_BYTES // (V * probs_NV.element_size()))
        for start in range(0, N, rows):
            block = slice(start, start + rows)
            logp_RV = hidden_NH[block].to(dtype) @ weight_HV  # [rows, V]
            logp_RV.mul_(inv_temperature_N[block, None])
            masked = _mask_rows(logp_RV, grammar_index_N, bitmask_MW, block)
            logp_RV.sub_(torch.logsumexp(logp_RV, dim=-1, keepdim=True))  # in place: now log p
            token_logp_N[block] = logp_RV.gather(1, tokens_N[block, None])[:, 0]
            probs_RV = torch.exp(logp_RV, out=probs_NV[block])
            if masked:  # p log p is 0 where p is 0, not 0 * -inf
                logp_RV.clamp_(min=torch.finfo(dtype).min)
            entropy_N[block] = -torch.bmm(
                probs_RV[:, None, :], logp_RV[:, :, None]
            ).flatten()  # row-wise dot, no [rows, V] temp
        ctx.save_for_backward(hidden_NH, weight_VH, tokens_N, inv_temperature_N, probs_NV)
        ctx.mark_non_differentiable(entropy_N)
        return token_logp_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logp_N, _grad_entropy):
        if getattr(ctx, "used", False):
            raise RuntimeError("token_logprobs: backward ran twice (its saved buffer is reused as the gradient)")
        ctx.used = True
        hidden_NH, weight_VH, tokens_N, inv_temperature_N, probs_NV = ctx.saved_tensors
        scale_N = grad_logp_N * inv_temperature_N
        grad_logits_NV = probs_NV.mul_(-scale_N[:, None])  # reuse the saved buffer: backward runs once
        grad_logits_NV.scatter_add_(1, tokens_N[:, None], scale_N[:, None])
        grad_hidden = grad_weight = None
        dtype = grad_logits_NV.dtype
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_logits_NV @ weight_VH.to(dtype)).to(hidden_NH.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_logits_NV.t() @ hidden_NH.to(dtype)).to(weight_VH.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _mask_rows(
    logits_RV: torch.Tensor, grammar_index_N: torch.Tensor | None, bitmask_MW: torch.Tensor | None, block: slice
) -> bool:
    """Add the grammar mask, in place, to the rows of ``logits_RV`` (rows ``block`` of N) that have one."""
    if grammar_index_N is None:
        return False
    index_R = grammar_index_N[block]
    rows = (index_R >= 0).nonzero()[:, 0]
    if len(rows) == 0:
        return False
    bias = mask_bias(bitmask_MW[index_R[rows]], logits_RV.shape[1]).to(logits_RV.dtype)
    logits_RV[rows] = logits_RV[rows] + bias
    return True


def masked_logits(logits_NV: torch.Tensor, grammar_index_N: torch.Tensor | None, bitmask_MW: torch.Tensor | None):
    """``logits_NV`` with the grammar mask added where a row has one (a new tensor; autograd-safe)."""
    if grammar_index_N is None or not bool((grammar_index_N >= 0).any()):
        return logits_NV
    rows = (grammar_index_N >= 0).nonzero()[:, 0]
    bias_NV = torch.zeros_like(logits_NV)
    bias_NV[rows] = mask_bias(bitmask_MW[grammar_index_N[rows]], logits_NV.shape[1]).to(logits_NV.dtype)
    return logits_NV + bias_NV


def token_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    tokens_N: torch.Tensor,
    temperature_N: torch.Tensor,
    grammar_index_N: torch.Tensor | None = None,
    bitmask_MW: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each token, entropy of each row's distribution) under ``softmax(h W^T / T)``,
    masked by its grammar where ``grammar_index_N`` names a row of ``bitmask_MW`` (-1: no mask).

    Differentiable in ``hidden`` (and ``weight`` if it requires grad); the entropy is a
    detached metric. Computed in fp32 (fp64 for fp64 inputs) whatever the input dtype.

    >>> h, w = torch.tensor([[1.0]]), torch.tensor([[0.0], [1.0986123]])  # logits [0, ln 3]
    >>> [round(float(x), 3) for x in token_logprobs(h, w, torch.tensor([1]), torch.tensor([1.0]))]
    [-0.288, 0.562]
    """
    return _TokenLogprobs.apply(
        hidden_NH,
        weight_VH,
        tokens_N,
        1.0 / temperature_N.to(torch.promote_types(hidden_NH.dtype, torch.float32)),
        grammar_index_N,
        bitmask_MW,
    )
