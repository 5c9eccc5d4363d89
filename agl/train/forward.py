"""The trainer's forward pass: per completion position, the policy's log-prob of the sampled token.

Shared by GRPO (``completion_logprobs``) and SFT (``fused_head``): only real completion positions
reach the vocabulary, through the fused log-prob head (``agl.train.logprobs``) when the output layer
is a plain linear, so no [B, T, V] logits exist. A group's prompt can run once for all the
micro-batches it is cut into (``SharedPrompt``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from agl.policy.load import Policy
from agl.train.logprobs import masked_logits, token_logprobs
from agl.train.token_batch import TokenBatch


def _decoder_or_model(policy: Policy, decoder_only: bool):
    """``run(keep, **inputs)`` -> (outputs, the model's return value): the final hidden states
    (``decoder_only``; the vocabulary projection is left to ``token_logprobs``) or the full model's
    logits for the last ``keep`` positions (0: all)."""
    model = policy.model.get_base_model()

    def run(keep: int = 0, **inputs: Any) -> tuple[torch.Tensor, Any]:
        if decoder_only:
            out = model.get_decoder()(**inputs)
            return out.last_hidden_state, out
        out = model(**inputs, logits_to_keep=keep)
        return out.logits, out

    return run


class SharedPrompt:
    """A group's prompt, run once for all the micro-batches the group is cut into.

    Its outputs (the last position's output, which predicts completion token 0, and every
    layer's keys and values) go to each micro-batch as the same tensors. Under autograd they are
    detached leaves: each micro-batch's backward stops there and adds its gradient to theirs,
    and ``backward()``, after the group's last micro-batch, runs the prompt's own backward once
    with the sum. The gradients are those of one pass over the whole group, summed in another order.
    """

    def __init__(self, policy: Policy, prompt_ids: Sequence[int], decoder_only: bool, detach: bool = True):
        """``detach=False``: the micro-batch's backward runs through the prompt's (one micro-batch per group)."""
        self.ids, self.decoder_only = list(prompt_ids), decoder_only
        outputs, out = _decoder_or_model(policy, decoder_only)(
            1, input_ids=torch.tensor([self.ids], device=policy.device), use_cache=True
        )
        self.cache = out.cache
        self.outputs = [outputs[:, -1:]] + [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
        detach = detach and torch.is_grad_enabled()
        self.inputs = [t.detach().requires_grad_() for t in self.outputs] if detach else self.outputs

    def expanded(self, rows: int) -> tuple[torch.Tensor, Any]:
        """(the output predicting token 0, [rows, 1, H or V]; a KV cache of the prompt for ``rows`` rows)."""
        cache = copy.copy(self.cache)  # the layers' other state (lengths, sliding windows) as after the prompt
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]
        for i, layer in enumerate(cache.layers):  # one prompt KV for every row; gradients from all rows sum into it
            keys, values = self.inputs[1 + 2 * i], self.inputs[2 + 2 * i]
            layer.keys, layer.values = keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1)
        return self.inputs[0].expand(rows, -1, -1), cache

    def backward(self) -> None:
        """The prompt's backward, with the gradients its micro-batches left on its outputs."""
        pairs = [
            (out, leaf.grad)
            for out, leaf in zip(self.outputs, self.inputs)
            if out is not leaf and leaf.grad is not None
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        self.outputs = self.inputs = []


def _forward(policy: Policy, batch: TokenBatch, decoder_only: bool, prompt: SharedPrompt | None = None) -> torch.Tensor:
    """Per completion position, the model output that predicts that token. [B, T, H or V]

    ``decoder_only``: the final hidden states (the vocabulary projection is left to
    ``token_logprobs``); otherwise the full model's logits. ``prompt``: the shared prompt's pass,
    already run (a group cut into several micro-batches); else the shared layout runs its own.
    """
    device = policy.device
    run = _decoder_or_model(policy, decoder_only)
    T = batch.completion_BT.shape[1]
    if batch.shared_prompt is None:
        attention = batch.attention_mask_BL.to(device)
        outputs, _ = run(
            T + 1,  # the output at position t predicts token t+1
            input_ids=batch.input_ids_BL.to(device),
            attention_mask=attention,
            position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        )
        return outputs[:, -T - 1 : -1]
    B, P = batch.completion_BT.shape[0], len(batch.shared_prompt)
    if prompt is None:
        prompt = SharedPrompt(policy, batch.shared_prompt, decoder_only, detach=False)
    if prompt.ids != batch.shared_prompt or prompt.decoder_only != decoder_only:
        raise ValueError("the shared prompt's pass is of another prompt or output")
    first, cache = prompt.expanded(B)
    attention = torch.cat([torch.ones((B, P), dtype=torch.long), batch.completion_attention_BT], dim=1).to(device)
    outputs, _ = run(
        input_ids=batch.completion_BT.to(device),
        attention_mask=attention,
        position_ids=torch.arange(P, P + T, device=device).expand(B, -1),
        cache=cache,
        use_cache=True,
    )
    return torch.cat([first, outputs[:, :-1]], dim=1)  # the prompt's last output predicts token 0


def fused_head(policy: Policy) -> torch.nn.Linear | None:
    """The output layer, when logits are exactly ``h @ W.T`` (no bias, soft-capping or scaling),
    so ``token_logprobs`` may compute them; else None and the model computes its own logits."""
    head = policy.model.get_base_model().get_output_embeddings()
    plain = type(head) is torch.nn.Linear and head.bias is None
    return head if plain and _head_gives_logits(policy) else None


def _head_gives_logits(policy: Policy) -> bool:
    """Whether the model's logits are its output layer's output as is (no soft-capping or scaling after it)."""
    config = policy.model.get_base_model().config
    return all(
        getattr(config, name, None) in (None, 1.0)
        for name in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    )


def completion_logprobs(
    policy: Policy,
    batch: TokenBatch,
    with_entropy: bool = False,
    fused: bool = True,
    prompt: SharedPrompt | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens under the policy, at each sample's temperature. [B, T]

    With ``with_entropy``, also each position's entropy (detached). [B, T]
    Only real completion positions reach the vocabulary: through ``token_logprobs`` for a plain
    output layer (``fused_head``), else through the output layer itself (a LoRA-wrapped or biased
    one) when the model's logits are its output as is. ``fused=False`` forces the model's own
    logits at every position (the path for soft-capped or scaled logits, and a reference in tests).
    ``prompt``: the shared prompt's pass (``SharedPrompt``), run once for a group cut into several
    micro-batches; it must have been made with ``uses_hidden_states(policy, fused)``.
    """
    device = policy.device
    tokens_BT = batch.completion_BT.to(device)
    B, T = tokens_BT.shape
    temperature_BT = batch.temperature_B.to(device)[:, None].expand(B, T)
    head = fused_head(policy) if fused else None
    real_BT = batch.completion_attention_BT.to(device).bool()  # padding needs no vocabulary projection
    # grammar-sampled positions: masked as the sampler masked them (agl.policy.grammar)
    grammar_BT = batch.grammar_index_BT.to(device) if batch.grammar_index_BT is not None else None
    bitmask_MW = batch.grammar_bitmask_MW.to(device) if batch.grammar_bitmask_MW is not None else None
    entropy_BT = None
    if head is not None:
        hidden_BTH = _forward(policy, batch, decoder_only=True, prompt=prompt)
        logp_N, entropy_N = token_logprobs(
            hidden_BTH[real_BT],
            head.weight,
            tokens_BT[real_BT],
            temperature_BT[real_BT],
            grammar_BT[real_BT] if grammar_BT is not None else None,
            bitmask_MW,
        )
        logp_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, logp_N)
        entropy_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, entropy_N) if with_entropy else None
        return logp_BT.cpu(), (entropy_BT.cpu() if entropy_BT is not None else None)
    if uses_hidden_states(policy, fused):  # the output layer on real positions only
        hidden_NH = _forward(policy, batch, decoder_only=True, prompt=prompt)[real_BT]
        logits_XV = (
            policy.model.get_base_model().get_output_embeddings()(hidden_NH).float() / temperature_BT[real_BT][:, None]
        )
        logits_XV = masked_logits(logits_XV, grammar_BT[real_BT] if grammar_BT is not None else None, bitmask_MW)
        tokens_X = tokens_BT[real_BT]
    else:
        logits_XV = _forward(policy, batch, decoder_only=False, prompt=prompt).float() / temperature_BT[..., None]
        if grammar_BT is not None:
            flat_NV = logits_XV.reshape(B * T, -1)
            logits_XV = masked_logits(flat_NV, grammar_BT.reshape(-1), bitmask_MW).view(B, T, -1)
        tokens_X = tokens_BT
    logp_X = logits_XV.gather(-1, tokens_X[..., None])[..., 0] - torch.logsumexp(logits_XV, dim=-1)
    if with_entropy:
        with torch.no_grad():
            log_probs = torch.log_softmax(logits_XV, dim=-1)
            entropy_BT = -(log_probs.exp() * log_probs.clamp(min=torch.finfo(log_probs.dtype).min)).sum(-1)
    if logp_X.dim() == 1:  # real positions only: back to [B, T]
        logp_X = torch.zeros((B, T), device=device).masked_scatter(real_BT, logp_X)
        if entropy_BT is not None:
            entropy_BT = torch.zeros((B, T), device=device).masked_scatter(real_BT, entropy_BT)
    return logp_X.cpu(), (entropy_BT.detach().cpu() if entropy_BT is not None else None)


def uses_hidden_states(policy: Policy, fused: bool = True) -> bool:
    """Whether ``completion_logprobs(policy, ..., fused=fused)`` projects hidden states itself
    (else the model computes logits): what a ``SharedPrompt`` for it must hold."""
    return fused and _head_gives_logits(policy)
