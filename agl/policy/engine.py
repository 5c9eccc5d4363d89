"""The generation engine: continuous batching over one policy, token by token.

Every request becomes one or more sequences (``n``). Sequences live in one batch whose KV
cache is left-padded to a common length, each row a slot of agl.policy.kv_cache's buffers (a finished
row's slot is refilled, not the cache copied). Each engine step:

  1. admits waiting requests (up to ``max_batch_size`` rows and a prefill-token budget):
     their prompts are prefilled together, identical prompts only once (``n > 1`` and a
     GRPO group share their prefill), and the new rows join the batch;
  2. decodes one token for every row;
  3. drops rows that finished (stop token, length, or cancelled), freeing their slots.

Batch invariance: on a CPU, a row's floating-point result depends on the batch around it
(matrix-multiply blocking, the amount of left padding), by ~1e-6 in float32. So a sequence's
log-probs, and now and then a token, would depend on which requests happened to be running
with it, i.e. on scheduling. With ``batch_invariant=True`` every sequence is prefilled alone
and decoded as its own batch of one: what it samples is a function of its prompt, its
parameters and its seed only, which is what makes a seeded run repeat bit for bit. It gives
up batching (a step costs one forward pass per row), so it is the float32 default, not bf16's.

The model runs on the process's compute thread (agl.policy.compute_thread) so the event loop (and the
HTTP route on it) stays responsive. ``paused()`` waits for the current step to end and holds the engine still, so
the trainer never changes weights under a running forward pass.

What is recorded per token is exactly what was sampled: the token id and its log-prob under
the sampling distribution, ``log_softmax(logits / temperature)`` (raw logits when greedy),
before any top-p truncation. The trainer recomputes the same quantity.

A sequence with a grammar (``SamplingParams.grammar``, agl.policy.grammar) samples from the masked
distribution: ``log_softmax(logits / temperature + mask)``, the mask 0 on the tokens its grammar
allows next and -inf elsewhere, before greedy, top-p and the draw alike; that is the log-prob it
records, with how many tokens the grammar allowed (``SequenceStream.allowed``: 1 means the token
was forced). Rows without a grammar pay nothing: no mask is made for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import torch
from transformers import DynamicCache

from agl.config import EngineConfig
from agl.policy import compute_thread
from agl.policy.decode import decode_step
from agl.policy.grammar import Grammar, GrammarState, allowed_counts, bitmask_words, mask_bias, policy_grammar_tokenizer
from agl.policy.graph_decode import graph_decode_step
from agl.policy.kv_cache import add_rows, cache_from_tensors, keep_rows, slot_cache, slot_moves
from agl.policy.load import Policy
from agl.policy.sampler_weights import MergedSampler

GREEDY = 0.0
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0  # alternatives per token to return
    stop_token_ids: tuple[int, ...] = ()  # extra stop ids besides the policy's eos ids
    ignore_eos: bool = False  # benchmarks: always sample max_tokens
    grammar: Grammar | None = None  # the tokens must follow it (agl.policy.grammar); it ends on an eos token


@dataclasses.dataclass
class TokenEvent:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None
    allowed: int = 0  # with a grammar: how many tokens it allowed here (1: forced); 0 without one


_DONE = object()


class SequenceStream:
    """One sampled continuation of a prompt; async-iterate it for tokens as they arrive."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int]):
        self.prompt_ids = prompt_ids
        self.params = params
        self.stop_ids = stop_ids
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if params.top_logprobs else None
        self.grammar: GrammarState | None = None  # set by the engine for a request with a grammar
        self.allowed: list[int] = []  # per token, with a grammar: how many tokens it allowed (1: forced)
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (the engine step failed)
        self.error: str | None = None  # with "error": what the step raised
        self.policy_version: int | None = None
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None  # joined the running batch (queue time ends)
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.cancelled = False
        self.generator: torch.Generator | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._done = asyncio.Event()

    def cancel(self) -> None:
        """Free this sequence's slot at the next step (client gone, or a stop string matched)."""
        self.cancelled = True

    async def wait(self) -> SequenceStream:
        await self._done.wait()
        return self

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while (event := await self._events.get()) is not _DONE:
            yield event

    # -- called by the engine, on the event loop
    def _push(
        self, token_id: int, logprob: float, top: list[tuple[int, float]] | None, version: int, allowed: int = 0
    ) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.policy_version = version
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top or [])
        if self.grammar is not None:
            self.allowed.append(allowed)
        self._events.put_nowait(TokenEvent(token_id, logprob, top, allowed))

    def _finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finished_at = time.perf_counter()
            self._events.put_nowait(_DONE)
            self._done.set()


@dataclasses.dataclass
class _Batch:
    """The running rows: their sequences and the KV cache they share (row i of every tensor,
    and the cache's row slot i, belong to ``seqs[i]``), left-padded to a common width."""

    seqs: list[SequenceStream]
    cache: DynamicCache
    mask: torch.Tensor  # [B, T] 1 where a cached position is real, 0 where it is left padding
    positions: torch.Tensor  # [B] position id of each row's next token
    last_tokens: torch.Tensor  # [B] each row's most recent token, fed at the next decode
    # the rows (ascending) still running after the event loop retired the others: the next step drops the rest
    # (``_keep_rows``) on the compute thread, where the cache's rows move (agl.policy.compute_thread); None: all
    keep: list[int] | None = None

    def live(self) -> list[int]:
        return list(range(len(self.seqs))) if self.keep is None else self.keep


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _keep_rows(batch: _Batch, keep: list[int]) -> _Batch:
    """``batch`` with only the rows ``keep`` (ascending), minus leading columns that are padding in
    all of them. The cache is shrunk in place: each kept row past the new end moves into a freed
    slot before it (one row copied each, not the whole cache), so the rows' order changes."""
    moves, order = slot_moves(keep)
    index = torch.tensor(order)
    mask = batch.mask[index]
    first_real = int((mask.sum(0) > 0).nonzero()[0])  # columns padded in every row are dead weight
    keep_rows(batch.cache, moves, len(keep), first_real)  # in the step's inference mode, as the cache was made
    return _Batch(
        seqs=[batch.seqs[i] for i in order],
        cache=batch.cache,
        mask=mask[:, first_real:],
        positions=batch.positions[index],
        last_tokens=batch.last_tokens[index],
    )


def _own_row(batch: _Batch, row: int, cache_sizes: dict[str, int]) -> _Batch:
    """Row ``row`` of ``batch`` as a batch of its own, with a copy of its cache."""
    first_real = int(batch.mask[row].nonzero()[0])
    tensors = [
        (k[row : row + 1, :, first_real:], v[row : row + 1, :, first_real:]) for k, v in _cache_tensors(batch.cache)
    ]
    sizes = {**cache_sizes, "min_rows": 1} if cache_sizes else {}  # a batch of one stays one
    return _Batch(
        seqs=[batch.seqs[row]],
        cache=cache_from_tensors(tensors, **sizes),
        mask=batch.mask[row : row + 1, first_real:],
        positions=batch.positions[row : row + 1],
        last_tokens=batch.last_tokens[row : row + 1],
    )


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = width
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class Engine:
    def __init__(
        self,
        policy: Policy,
        max_batch_size: int = EngineConfig.max_batch_size,
        max_prefill_tokens: int = EngineConfig.max_prefill_tokens,
        batch_wait_s: float = 0.005,
        weights: str = EngineConfig.weights,
        batch_invariant: bool = False,
        adapter: bool = True,
        decode: str = EngineConfig.decode,
        decode_4bit_rows: int = EngineConfig.decode_4bit_rows,
    ):
        """``adapter=False``: sample from the frozen base model (the route's helper models), a dense
        copy of the base weights whatever ``weights`` says, since the policy's own modules cannot
        switch their adapter off for one engine while the other samples through them."""
        if weights not in ("merged", "adapter"):
            raise ValueError(f"engine.weights '{weights}' is not one of: merged, adapter")
        self.policy = policy
        # merged: one dense matmul per layer (see agl.policy.sampler_weights); adapter: the training model itself
        self.adapter = adapter
        self.merged = (
            MergedSampler(policy.model, policy.compute_dtype, lora=adapter)
            if weights == "merged" or not adapter
            else None
        )
        if decode not in ("fast", "model", "graph"):
            raise ValueError(f"engine.decode '{decode}' is not one of: fast, model, graph")
        # fast: agl.policy.decode's step for Llama-family dense samplers (None where it does not apply);
        # graph: the same in static shapes, replayed as a CUDA graph on a GPU (agl.policy.graph_decode)
        self.decode_step = None
        self._cache_sizes: dict[str, int] = {}  # a graph step's room in every new KV cache (agl.policy.kv_cache)
        if decode == "fast":
            self.decode_step = decode_step(self.merged, decode_4bit_rows)
        elif decode == "graph":
            self.decode_step = graph_decode_step(self.merged, capture=None if not batch_invariant else False)
            if self.decode_step is not None:
                self._cache_sizes = {"min_rows": max_batch_size, "min_columns": 256}
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.batch_wait_s = batch_wait_s  # let requests sent together be prefilled together
        self.batch_invariant = batch_invariant
        self._waiting: list[SequenceStream] = []
        self._batches: list[_Batch] = []  # the running rows: one batch, or one per row if batch-invariant
        self._wake = asyncio.Event()
        self._pausers = 0
        self._paused = asyncio.Event()  # set while the loop is held between steps
        self._resume = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.generator = torch.Generator(device="cpu").manual_seed(0)
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer, made at the first grammar
        self.stats = {
            "steps": 0,
            "prefill_tokens": 0,
            "prefill_shared_tokens": 0,
            "decode_tokens": 0,
            "failed_steps": 0,
        }

    # ------------------------------------------------------------------ public API

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="agl-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await compute_thread.run(lambda: None)  # a step still running ends first: the thread runs calls in order
        for seq in self._waiting + self._running_seqs():
            seq._finish("abort")
        self._waiting, self._batches = [], []

    def submit(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> list[SequenceStream]:
        """Queue ``n`` continuations of ``prompt_ids``; they share one prefill."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(prompt_ids) + params.max_tokens > self.policy.context_length:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length ({self.policy.context_length})"
            )
        if params.grammar is not None and params.ignore_eos:
            raise ValueError("a grammar ends on an eos token: it cannot be combined with ignore_eos")
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.policy.eos_token_ids)
        )
        if params.grammar is not None and self._grammar_tokenizer is None:
            self._grammar_tokenizer = policy_grammar_tokenizer(self.policy)
        seqs = []
        for i in range(n):
            seq = SequenceStream(list(prompt_ids), params, stop_ids)
            if params.grammar is not None:
                seq.grammar = GrammarState(params.grammar, self._grammar_tokenizer)
            if params.seed is not None:  # each choice of a seeded request gets its own fixed stream
                # mix (seed, choice) so seed=1 choice 1 and seed=2 choice 0 do not share a stream
                seq.generator = torch.Generator(device="cpu").manual_seed(hash((params.seed, i)) & (2**63 - 1))
            seqs.append(seq)
        self._waiting.extend(seqs)
        self._wake.set()
        return seqs

    @contextlib.asynccontextmanager
    async def paused(self):
        """Hold the engine between steps: no forward pass runs until the block exits."""
        self._pausers += 1
        self._resume.clear()
        self._wake.set()
        try:
            if self._task is not None and not self._task.done():
                await self._paused.wait()
            yield
        finally:
            self._pausers -= 1
            if self._pausers == 0:
                self._paused.clear()
                self._resume.set()

    @property
    def num_running(self) -> int:
        return sum(len(batch.live()) for batch in self._batches)

    def _running_seqs(self) -> list[SequenceStream]:
        return [batch.seqs[i] for batch in self._batches for i in batch.live()]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            if self._pausers:
                self._paused.set()
                await self._resume.wait()
                continue
            self._drop_cancelled_waiting()
            if not self._waiting and not self._batches:
                self._wake.clear()
                await self._wake.wait()
                if self.batch_wait_s and not self._pausers:
                    await asyncio.sleep(self.batch_wait_s)
                continue
            admit = self._take_admissions()
            version = self.policy.version
            try:
                results = await compute_thread.run(self._step, admit)
            except Exception as error:  # a step that raises fails the sequences in it, not every request after it
                self._fail_all(admit, error)
                continue
            for seq, token, logprob, top, allowed in results:
                if seq.finish_reason is None:
                    seq._push(token, logprob, top, version, allowed)
            self._retire_finished()
            self.stats["steps"] += 1

    def _fail_all(self, admitted: list[SequenceStream], error: Exception) -> None:
        """End every sequence of the failed step (``finish_reason`` "error"): their KV rows are in an
        unknown state. Waiting sequences were not in it and run next."""
        log.error(
            "engine step failed; its %d sequences end with an error",
            len(admitted) + len(self._running_seqs()),
            exc_info=error,
        )
        for seq in admitted + self._running_seqs():
            seq.error = f"{type(error).__name__}: {error}"
            seq._finish("error")
        self._batches = []
        self.stats["failed_steps"] += 1

    def _drop_cancelled_waiting(self) -> None:
        for seq in [s for s in self._waiting if s.cancelled]:
            seq._finish("abort")
        self._waiting = [s for s in self._waiting if not s.cancelled]

    def _take_admissions(self) -> list[SequenceStream]:
        room = self.max_batch_size - self.num_running
        admit, budget, seen = [], self.max_prefill_tokens, set()
        while self._waiting and len(admit) < room:
            prompt = tuple(self._waiting[0].prompt_ids)
            cost = 0 if prompt in seen else len(prompt)
            if admit and cost and cost > budget:  # a prompt this admission prefills already costs nothing more
                break
            budget -= cost
            seen.add(prompt)
            seq = self._waiting.pop(0)
            seq.admitted_at = time.perf_counter()
            admit.append(seq)
        return admit

    def _retire_finished(self) -> None:
        """Finish rows that hit a stop condition or were cancelled; the next step drops them from their batch."""
        self._batches = [kept for batch in self._batches if (kept := self._retire_rows(batch)) is not None]

    def _retire_rows(self, batch: _Batch) -> _Batch | None:
        """``batch`` with its finished rows marked to go (``_Batch.keep``); None if none is left. Only the
        sequences are touched here, on the event loop: the tensors move on the compute thread."""
        keep = []
        for i in batch.live():
            seq = batch.seqs[i]
            if seq.error is not None:  # its grammar failed (agl.policy.grammar): this sequence alone ends
                seq._finish("error")
            elif seq.cancelled:
                seq._finish("abort")
            elif seq.token_ids and seq.token_ids[-1] in seq.stop_ids:
                seq._finish("stop")
            elif (
                len(seq.token_ids) >= seq.params.max_tokens
                or len(seq.prompt_ids) + len(seq.token_ids) >= self.policy.context_length
            ):
                seq._finish("length")
            else:
                keep.append(i)
        if not keep:
            return None
        if len(keep) < len(batch.seqs):
            batch.keep = keep
        return batch

    # ------------------------------------------------------------------ model work (the compute thread)

    @torch.inference_mode()
    def _step(self, admit: list[SequenceStream]) -> list[tuple[SequenceStream, int, float, list | None, int]]:
        """Decode one token for every running row, then prefill the admitted ones into the batch.

        Admitted rows get their first token from their prefill logits, so after this step every
        row is in the same state: a sampled last token whose KV is not cached yet.
        """
        self._batches = [batch if batch.keep is None else _keep_rows(batch, batch.keep) for batch in self._batches]
        results = []
        for seqs, logits, batch in self._forward_passes(admit):
            tokens, logprobs, tops, allowed = self._sample(seqs, logits)
            batch.last_tokens = tokens
            results += [
                (s, int(t), float(lp), top, n) for s, t, lp, top, n in zip(seqs, tokens, logprobs, tops, allowed)
            ]
        return results

    def _forward_passes(self, admit: list[SequenceStream]):
        for batch in self._batches:
            yield batch.seqs, self._decode(batch), batch
        if not admit:
            return
        if self.batch_invariant:  # each distinct prompt prefilled alone, each row its own batch
            by_prompt: dict[tuple[int, ...], list[SequenceStream]] = {}
            for seq in admit:
                by_prompt.setdefault(tuple(seq.prompt_ids), []).append(seq)
            for seqs in by_prompt.values():
                new_rows, logits = self._prefill(seqs)
                yield seqs, logits, new_rows
                self._batches += [_own_row(new_rows, i, self._cache_sizes) for i in range(len(seqs))]
        else:
            new_rows, logits = self._prefill(admit)
            yield admit, logits, new_rows
            self._merge(new_rows)

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        device = self.policy.device
        model = self.merged.model() if self.merged is not None else self.policy.model
        out = model(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,  # only the last position's logits are sampled from
        )
        return out.logits[:, -1].float().cpu()  # [B, V]

    def _prefill(self, seqs: list[SequenceStream]) -> tuple[_Batch, torch.Tensor]:
        """Prefill each distinct prompt once, then give every sequence its own row."""
        unique: dict[tuple[int, ...], int] = {}
        for seq in seqs:
            unique.setdefault(tuple(seq.prompt_ids), len(unique))
        prompts = list(unique)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.policy.eos_token_ids[0], dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = slot_cache(**self._cache_sizes)
        logits = self._forward(ids, mask, positions, cache)
        rows = torch.tensor([unique[tuple(s.prompt_ids)] for s in seqs])
        self.stats["prefill_tokens"] += sum(len(p) for p in prompts)
        self.stats["prefill_shared_tokens"] += sum(len(s.prompt_ids) for s in seqs) - sum(len(p) for p in prompts)
        if len(prompts) != len(seqs) or not torch.equal(rows, torch.arange(len(seqs))):
            cache = cache_from_tensors(  # a row per sequence
                [(k[rows], v[rows]) for k, v in _cache_tensors(cache)], **self._cache_sizes
            )
        batch = _Batch(
            seqs=list(seqs),
            cache=cache,
            mask=mask[rows],
            positions=mask[rows].sum(-1),
            last_tokens=torch.zeros(len(seqs), dtype=torch.long),
        )
        return batch, logits[rows]

    def _merge(self, new: _Batch) -> None:
        """Append new rows to the running batch (into its cache's free slots), left-padding
        whichever side is narrower."""
        if not self._batches:
            self._batches = [new]
            return
        old = self._batches[0]
        t_old, t_new = old.mask.shape[1], new.mask.shape[1]
        width = max(t_old, t_new)
        add_rows(old.cache, new.cache)
        old.mask = torch.cat([_left_pad(old.mask, width - t_old, 1), _left_pad(new.mask, width - t_new, 1)])
        old.positions = torch.cat([old.positions, new.positions])
        old.last_tokens = torch.cat([old.last_tokens, new.last_tokens])
        old.seqs = old.seqs + new.seqs

    def _decode(self, batch: _Batch) -> torch.Tensor:
        batch.mask = torch.cat([batch.mask, torch.ones((len(batch.seqs), 1), dtype=torch.long)], dim=1)
        if self.decode_step is not None:
            logits = self.decode_step(batch.last_tokens, batch.positions, batch.mask, batch.cache)
        else:
            logits = self._forward(batch.last_tokens[:, None], batch.mask, batch.positions[:, None], batch.cache)
        batch.positions = batch.positions + 1
        self.stats["decode_tokens"] += len(batch.seqs)
        return logits

    def _uniforms(self, seqs: list[SequenceStream]) -> torch.Tensor:
        """One uniform per row: from the row's own generator when its request set a seed."""
        shared = torch.rand(len(seqs), generator=self.generator, dtype=torch.float64)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                shared[i] = torch.rand((), generator=seq.generator, dtype=torch.float64)
        return shared

    def _sample(
        self, seqs: list[SequenceStream], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list, list[int]]:
        """Sample one token per row with that row's own temperature, top-p, seed and grammar (a greedy
        row, a T=1 row and a T=0.7, top_p=0.9 row in one batch each get their own distribution).

        Runs on the logits' device (a GPU's, after a graph step: agl.policy.graph_decode); the draws' uniforms
        come from the host's generators as ever, so a seeded request draws the same whatever its batch and
        device. What comes back to the host is a token and a log-prob per row (and any top log-probs)."""
        device = logits.device
        temps = torch.tensor([s.params.temperature for s in seqs])
        greedy = temps <= GREEDY
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None].to(device)  # [B, V]
        allowed = self._apply_grammars(seqs, scaled)
        logprobs_all = torch.log_softmax(scaled, dim=-1)  # [B, V] the recorded distribution
        tokens = logprobs_all.argmax(-1)
        sample_rows = (~greedy).nonzero().flatten().tolist()
        if sample_rows:
            probs = logprobs_all[sample_rows].exp()  # [S, V]
            top_ps = torch.tensor([seqs[i].params.top_p for i in sample_rows])
            if (top_ps < 1).any():
                probs = _top_p_filter(probs, top_ps.to(device))
            tokens[sample_rows] = draw(probs, self._uniforms([seqs[i] for i in sample_rows]).to(device))
        chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
        tokens, chosen = tokens.cpu(), chosen.cpu()
        for row, seq in enumerate(seqs):
            if seq.grammar is not None and seq.error is None and not seq.grammar.consume(int(tokens[row])):
                seq.error = f"the grammar did not accept the sampled token {int(tokens[row])}: {seq.grammar.error}"
        tops = []
        for row, seq in enumerate(seqs):
            k = seq.params.top_logprobs
            if k:
                values, ids = logprobs_all[row].topk(k)
                tops.append(list(zip(ids.tolist(), values.tolist())))
            else:
                tops.append(None)
        return tokens, chosen, tops, allowed

    def _apply_grammars(self, seqs: list[SequenceStream], scaled_BV: torch.Tensor) -> list[int]:
        """Mask, in place, the rows whose sequence has a grammar: -inf on the tokens it does not allow
        next. Returns per row how many tokens were allowed (0 for rows without a grammar)."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None and seq.error is None]
        allowed = [0] * len(seqs)
        if not rows:
            return allowed
        V = scaled_BV.shape[1]
        bitmask_RW = torch.empty((len(rows), bitmask_words(V)), dtype=torch.int32)
        for r, i in enumerate(rows):
            seqs[i].grammar.fill(bitmask_RW[r])
        counts = allowed_counts(bitmask_RW, V).tolist()
        for r, i in enumerate(rows):
            if counts[r] == 0:  # nothing allowed: the grammar is in error; the row samples freely and ends
                seqs[i].error = f"the grammar allows no token: {seqs[i].grammar.error or 'it is in an error state'}"
                bitmask_RW[r] = -1
            allowed[i] = counts[r]
        bias_RV = mask_bias(bitmask_RW, V).to(scaled_BV.device)
        if len(rows) == len(seqs):
            scaled_BV.add_(bias_RV)
        else:
            scaled_BV.index_add_(0, torch.tensor(rows, device=scaled_BV.device), bias_RV)
        return allowed


def draw(probs_SV: torch.Tensor, uniforms_S: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform per row picks the token whose CDF interval holds it.

    One random number per row instead of one per vocabulary entry: with a 49k vocabulary,
    ``torch.multinomial`` (or an exponential race) spent a good part of a decode step drawing
    random numbers (docs/benchmarks-history.md#drawing-the-sampled-token). The CDF is accumulated
    in float64 so every token's interval has its probability's width to ~1e-16; ``right=True``
    never lands on a zero-probability token.

    >>> draw(torch.tensor([[0.2, 0.0, 0.8]]), torch.tensor([0.5])).tolist()
    [2]
    """
    cdf_SV = probs_SV.double().cumsum(-1)
    total_S = cdf_SV[:, -1]
    targets_S = torch.minimum(uniforms_S.double() * total_S, torch.nextafter(total_S, torch.zeros_like(total_S)))
    return torch.searchsorted(cdf_SV, targets_S[:, None], right=True)[:, 0]


def _top_p_filter(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero out the tail of each row beyond its nucleus (the smallest set with mass >= top_p).

    The most likely token always stays: a top_p too small for float32 (5e-324 is 0 there) would
    otherwise zero the whole row, and the draw would pick a token past the vocabulary (found by
    tests/test_route_fuzz.py)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    outside = before >= top_ps[:, None]
    outside[:, 0] = False
    sorted_probs[outside] = 0
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
