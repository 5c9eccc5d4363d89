"""Micro-batches: which samples share a forward/backward pass, and how they are laid out as tensors.

``plan_micro_batches`` cuts GRPO's samples so the passes run few padding tokens (a group's prompt
runs once, however many micro-batches the group is cut into); ``TokenBatch`` lays one micro-batch
out; ``sft_micro_batches`` is SFT's simpler plan over whole conversations.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import torch

from agl.train.samples import Sample


@dataclasses.dataclass
class TokenBatch:
    """Samples laid out for one forward pass; every tensor is aligned on the completion.

    Two layouts:
      - shared prompt (a GRPO group, or a part of one: ``SharedPrompt``): the prompt is run once,
        its KV cache is expanded to every row, and only the completions are run per row. For G=8 samples of a 150-token
        prompt and 128-token completions that is ~1,200 tokens instead of ~2,200.
      - padded: prompts left-padded, completions right-padded, one pass:
        [pad pad p p p | c c c pad], so ``logits_to_keep`` skips the prompt's vocab projection.
    """

    completion_BT: torch.Tensor  # completion token ids (right-padded)
    completion_attention_BT: torch.Tensor  # 1 on real completion tokens
    mask_BT: torch.Tensor  # float, 1 where the loss applies
    old_logp_BT: torch.Tensor
    temperature_B: torch.Tensor
    shared_prompt: list[int] | None = None  # set: the shared-prompt layout
    # grammar-sampled positions (agl.policy.grammar): row of grammar_bitmask_MW per position, -1 elsewhere
    grammar_index_BT: torch.Tensor | None = None
    grammar_bitmask_MW: torch.Tensor | None = None
    input_ids_BL: torch.Tensor | None = None  # padded layout only
    attention_mask_BL: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        samples: Sequence[Sample],
        pad_id: int,
        mask_truncated: bool,
        share_prompt: bool = True,
        min_shared_rows: int = 2,
        grammar_masks: Sequence[Sequence[tuple[int, torch.Tensor]]] | None = None,
    ) -> TokenBatch:
        """The shared-prompt layout when ``share_prompt``, every sample has one prompt and there are
        at least ``min_shared_rows`` rows (1 for a part of a group cut into micro-batches); else padded.

        ``grammar_masks``: per sample, (start, bitmask [L, W]) for each of its grammar-sampled spans
        (``agl.train.grpo.grammar_masks``): those positions' log-probs are masked as the sampler's were."""
        B, t_max = len(samples), max(len(s.completion_ids) for s in samples)
        completion = torch.full((B, t_max), pad_id, dtype=torch.long)
        completion_attention = torch.zeros((B, t_max), dtype=torch.long)
        mask = torch.zeros((B, t_max))
        old_logp = torch.zeros((B, t_max))
        for i, s in enumerate(samples):
            t = len(s.completion_ids)
            completion[i, :t] = torch.tensor(s.completion_ids)
            completion_attention[i, :t] = 1
            if not (mask_truncated and s.truncated):
                mask[i, :t] = torch.tensor(s.mask, dtype=torch.float32)
            old_logp[i, :t] = torch.tensor(s.logprobs, dtype=torch.float32)
        temperature = torch.tensor([s.temperature for s in samples], dtype=torch.float32)
        batch = cls(completion, completion_attention, mask, old_logp, temperature)
        if grammar_masks and any(grammar_masks):
            batch.grammar_index_BT = torch.full((B, t_max), -1, dtype=torch.long)
            bitmasks, rows = [], 0
            for i, spans in enumerate(grammar_masks):
                for start, bitmask_LW in spans:
                    batch.grammar_index_BT[i, start : start + len(bitmask_LW)] = torch.arange(
                        rows, rows + len(bitmask_LW)
                    )
                    bitmasks.append(bitmask_LW)
                    rows += len(bitmask_LW)
            batch.grammar_bitmask_MW = torch.cat(bitmasks)
        if share_prompt and B >= min_shared_rows and all(s.prompt_ids == samples[0].prompt_ids for s in samples):
            batch.shared_prompt = list(samples[0].prompt_ids)
            return batch
        p_max = max(len(s.prompt_ids) for s in samples)
        batch.input_ids_BL = torch.full((B, p_max + t_max), pad_id, dtype=torch.long)
        batch.attention_mask_BL = torch.zeros((B, p_max + t_max), dtype=torch.long)
        for i, s in enumerate(samples):
            p = len(s.prompt_ids)
            batch.input_ids_BL[i, p_max - p : p_max] = torch.tensor(s.prompt_ids)
            batch.input_ids_BL[i, p_max:] = completion[i]
            batch.attention_mask_BL[i, p_max - p : p_max] = 1
            batch.attention_mask_BL[i, p_max:] = completion_attention[i]
        return batch

    @property
    def num_input_tokens(self) -> int:
        """Tokens the forward pass runs (a shared prompt once), padding excluded."""
        completion = int(self.completion_attention_BT.sum())
        if self.shared_prompt is not None:
            return len(self.shared_prompt) + completion
        return int(self.attention_mask_BL.sum())


# Per micro-batch, a fixed cost in tokens of work (every layer's 4-bit weights dequantized in each
# pass, ~3,000 operator dispatches, the loss): cutting a group to save fewer padded tokens than
# this does not pay. Measured: BENCHMARKS.md "The update's micro-batch planner".
PASS_OVERHEAD_TOKENS = 64

# Update time and memory against the tokens trained on, this planner vs. the one before it (each
# group one micro-batch, padded to its longest completion). Measured: BENCHMARKS.md "The update's
# micro-batch planner".


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
