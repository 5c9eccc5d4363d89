"""One micro-batch of samples laid out as tensors for the trainer's forward pass (``TokenBatch``)."""

from __future__ import annotations

import dataclasses
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
        (``agl.train.micro_batches.grammar_masks``): those positions' log-probs are masked as the sampler's were."""
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
