"""Micro-batches: which samples share a forward/backward pass, laid out, and run through the policy.

``plan_micro_batches`` cuts GRPO's samples so the passes run few padding tokens (a group's prompt
runs once, however many micro-batches the group is cut into); ``StepBatches`` is a step's
micro-batches, laid out (``TokenBatch``), each token weighted over the whole step, with the masks
of grammar-sampled positions replayed; its ``passes`` runs them through the policy, the shared
prompt of a cut group once. ``sft_micro_batches`` is SFT's simpler plan over whole conversations.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence

import torch

from agl.policy.grammar import policy_grammar_tokenizer, replay
from agl.policy.load import Policy
from agl.train.forward import SharedPrompt, completion_logprobs, uses_hidden_states
from agl.train.loss import token_weights
from agl.train.samples import Sample
from agl.train.token_batch import TokenBatch


@dataclasses.dataclass
class MicroBatch:
    """One forward/backward pass of a step."""

    batch: TokenBatch
    advantages_B: torch.Tensor
    weights_BT: torch.Tensor  # each token's weight in the step's loss (``token_weights`` over the whole step)
    input_tokens: int  # tokens it runs through the model, padding excluded; a cut group's prompt counts once
    shared: bool = False  # one of the micro-batches of a group cut apart, which share one prompt pass
    opens: bool = False  # ... the first of them: it runs the prompt
    closes: bool = False  # ... the last: the prompt's backward runs after it
    ref_logp_BT: torch.Tensor | None = None  # the reference model's log-probs (a KL term)


class StepBatches:
    """A step's samples in micro-batches. Samples sampled under a grammar (structured outputs) have their
    masks rebuilt by replaying the grammar over the recorded tokens (``grammar_masks``), so the update's
    log-probs at those positions are the masked distribution's, as the sampler's were."""

    def __init__(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[float],
        policy: Policy,
        *,
        weighting: str,
        size: int | None,
        tokens: int | None,
        mask_truncated: bool,
    ):
        pad_id = policy.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else policy.eos_token_ids[0]
        chunks = plan_micro_batches(samples, size, tokens)
        start = time.perf_counter()
        masks = grammar_masks(samples, policy)
        self.grammar_replay_s = time.perf_counter() - start if any(s.constraints for s in samples) else 0.0
        # A group cut into several micro-batches runs its prompt once for all of them (SharedPrompt).
        prompts = [tuple(samples[chunk[0]].prompt_ids) for chunk in chunks]
        cuts = Counter(p for p, chunk in zip(prompts, chunks) if all(tuple(samples[i].prompt_ids) == p for i in chunk))
        parts = [p if cuts[p] > 1 else None for p in prompts]
        batches = [
            TokenBatch.build(
                [samples[i] for i in chunk],
                pad_id,
                mask_truncated,
                min_shared_rows=1 if part else 2,
                grammar_masks=[masks[i] for i in chunk],
            )
            for chunk, part in zip(chunks, parts)
        ]
        weights = step_weights([b.mask_BT for b in batches], weighting)
        self.items: list[MicroBatch] = []
        for i, (chunk, part, batch, w_BT) in enumerate(zip(chunks, parts, batches, weights)):
            opens = part is not None and (i == 0 or parts[i - 1] != part)
            closes = part is not None and (i + 1 == len(parts) or parts[i + 1] != part)
            reused = len(batch.shared_prompt) if part is not None and not opens else 0
            advantages_B = torch.tensor([advantages[i] for i in chunk], dtype=torch.float32)
            self.items.append(
                MicroBatch(batch, advantages_B, w_BT, batch.num_input_tokens - reused, part is not None, opens, closes)
            )

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.items)

    def passes(
        self, policy: Policy, *, with_entropy: bool = False, backward: bool = False, timings: dict | None = None
    ) -> Iterator[tuple[MicroBatch, torch.Tensor, torch.Tensor | None]]:
        """Each micro-batch with its completion log-probs (and entropies) under ``policy``, in order.

        A cut group's prompt runs once, with its first micro-batch. With ``backward``, the caller runs each
        micro-batch's backward before taking the next, and the prompt's own backward runs after the group's
        last. ``timings`` gets the passes' seconds (``forward_s``, and the prompts' ``backward_s``)."""
        timings = timings if timings is not None else defaultdict(float)
        hidden = uses_hidden_states(policy)
        prompt = None
        for mb in self.items:
            start = time.perf_counter()
            if mb.opens:
                prompt = SharedPrompt(policy, mb.batch.shared_prompt, hidden)
            logp_BT, entropy_BT = completion_logprobs(
                policy, mb.batch, with_entropy=with_entropy, prompt=prompt if mb.shared else None
            )
            timings["forward_s"] += time.perf_counter() - start
            yield mb, logp_BT, entropy_BT
            if backward and mb.closes:  # the group's last micro-batch: now the prompt's backward, once
                start = time.perf_counter()
                prompt.backward()
                prompt = None
                timings["backward_s"] += time.perf_counter() - start

    def logprobs(self, policy: Policy) -> list[torch.Tensor]:
        """Each micro-batch's completion log-probs under ``policy``, without gradients."""
        with torch.no_grad():
            return [logp_BT.detach() for _, logp_BT, _ in self.passes(policy)]


def step_weights(masks: Sequence[torch.Tensor], weighting: str) -> list[torch.Tensor]:
    """Each micro-batch's token weights, computed over the whole step (``token_weights`` of all its rows,
    padded to the longest), so that accumulating the micro-batches' losses gives the full batch's."""
    max_len = max(m.shape[1] for m in masks)
    all_mask = torch.zeros((sum(len(m) for m in masks), max_len))
    row = 0
    for m in masks:
        all_mask[row : row + len(m), : m.shape[1]] = m
        row += len(m)
    all_weights = token_weights(all_mask, weighting, max_len)
    out, row = [], 0
    for m in masks:
        out.append(all_weights[row : row + len(m), : m.shape[1]])
        row += len(m)
    return out


def grammar_masks(samples: Sequence[Sample], policy: Policy) -> list[list[tuple[int, torch.Tensor]]]:
    """Per sample, (start, bitmask [L, W]) for each of its grammar-sampled spans: the masks the
    sampler used, rebuilt by replaying each grammar over the recorded tokens (agl.policy.grammar.replay)."""
    if not any(s.constraints for s in samples):
        return [[] for _ in samples]
    tokenizer = policy_grammar_tokenizer(policy)
    return [
        [(c.start, replay(c.grammar, s.completion_ids[c.start : c.start + c.length], tokenizer)) for c in s.constraints]
        for s in samples
    ]


# Per micro-batch, a fixed cost in tokens of work (every layer's 4-bit weights dequantized in each
# pass, ~3,000 operator dispatches, the loss): cutting a group to save fewer padded tokens than
# this does not pay (why 64: docs/benchmarks-history.md#micro-batch-planner).
PASS_OVERHEAD_TOKENS = 64


def plan_micro_batches(
    samples: Sequence[Sample], size: int | None = None, tokens: int | None = None
) -> list[list[int]]:
    """Indices per micro-batch, cut so the passes run few padding tokens; a function of the
    samples' contents, not of their order.

    Samples sharing a prompt form a group, whose prompt runs once (``TokenBatch``'s shared-prompt
    layout) however many micro-batches the group is cut into; the others ("singles") go through
    the padded layout. Each kind is sorted longest first and cut into consecutive runs that
    minimize the tokens run, padding included, plus ``PASS_OVERHEAD_TOKENS`` per micro-batch,
    within two caps: at most ``size`` rows, and at most ``tokens`` tokens, padding included (a
    group's micro-batch: its prompt + rows x its longest completion; singles: rows x (longest
    prompt + longest completion)). A sample over ``tokens`` alone gets a micro-batch of its own.
    ``None``: no cap.

    Groups come first, ordered by prompt, each group's micro-batches next to each other; then the
    singles. Equal lengths are ordered by token ids, then rollout id: only exact duplicates may
    trade places.
    """
    if size is not None and size < 1 or tokens is not None and tokens < 1:
        raise ValueError(f"micro-batch caps must be positive or None (size={size}, tokens={tokens})")
    by_prompt: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_prompt[tuple(sample.prompt_ids)].append(i)

    def longest_first(i: int) -> tuple:
        s = samples[i]
        return (-len(s.prompt_ids) - len(s.completion_ids), s.completion_ids, s.prompt_ids, str(s.rollout_id))

    plan: list[list[int]] = []
    for prompt in sorted(p for p, idx in by_prompt.items() if len(idx) > 1):
        order = sorted(by_prompt[prompt], key=longest_first)
        runs = _cut([0] * len(order), [len(samples[i].completion_ids) for i in order], len(prompt), size, tokens)
        plan += [order[a:b] for a, b in runs]
    singles = sorted((idx[0] for idx in by_prompt.values() if len(idx) == 1), key=longest_first)
    runs = _cut(
        [len(samples[i].prompt_ids) for i in singles],
        [len(samples[i].completion_ids) for i in singles],
        0,
        size,
        tokens,
    )
    return plan + [singles[a:b] for a, b in runs]


def _cut(
    prompts: list[int], completions: list[int], shared: int, size: int | None, tokens: int | None
) -> list[tuple[int, int]]:
    """Consecutive runs [a, b) covering every row, with the least total of padded tokens
    (rows x (longest prompt + longest completion)) plus ``PASS_OVERHEAD_TOKENS`` per run, each
    within the caps (``tokens`` also counts the ``shared`` prompt; a run of one is always allowed);
    on equal cost, fewer runs. Dynamic programming over the run ends, O(rows^2) at most."""
    best: list[tuple[int, int, int]] = [(0, 0, 0)]  # per prefix end b: (cost, runs, start of the last run)
    for b in range(1, len(prompts) + 1):
        options, p_max, c_max = [], 0, 0
        for a in range(b - 1, -1, -1):  # the last run is [a, b): it grows as a falls, and so do its tokens
            p_max, c_max = max(p_max, prompts[a]), max(c_max, completions[a])
            padded = (b - a) * (p_max + c_max)
            if b - a > 1 and (size is not None and b - a > size or tokens is not None and shared + padded > tokens):
                break
            options.append((best[a][0] + padded + PASS_OVERHEAD_TOKENS, best[a][1] + 1, -a))
        cost, runs, a = min(options)  # ties: the fewest runs, then the longest earlier runs
        best.append((cost, runs, -a))
    runs, b = [], len(prompts)
    while b > 0:
        runs.append((best[b][2], b))
        b = best[b][2]
    return runs[::-1]


def sft_micro_batches(
    lengths: Sequence[int], micro_batch_size: int, micro_batch_tokens: int | None = None
) -> list[list[int]]:
    """Example indices in micro-batches: sorted by length (less padding), at most ``micro_batch_size``
    rows and, when set, ``micro_batch_tokens`` tokens padding included (rows x the longest) per pass;
    an example longer than the budget is a pass of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[list[int]] = []
    for i in order:
        chunk = chunks[-1] if chunks else None
        fits = chunk is not None and len(chunk) < micro_batch_size
        if fits and micro_batch_tokens:
            fits = (len(chunk) + 1) * lengths[i] <= micro_batch_tokens  # sorted: the new one is the longest
        if fits:
            chunk.append(i)
        else:
            chunks.append([i])
    return chunks
