"""Grammar-constrained decoding: per sequence, a matcher that says which tokens may come next.

The route turns a request's structure (a JSON schema, forced tool calls) into a grammar
(``Grammar``: llguidance's grammar text, JSON schemas and Lark rules); the engine gives each such
sequence a ``GrammarState``, which before every sampled token fills a bitmask of the tokens the
grammar allows there, and after it consumes the token. The sampler adds ``mask_bias`` (0 where
allowed, -inf elsewhere) to the row's temperature-scaled logits: the distribution it samples from,
and whose log-prob it records, is the masked one.

Why llguidance (docs/benchmarks-history.md#structured-outputs): no dependencies (a 7.6 MB
wheel), works from a Hugging Face fast tokenizer, a mask costs microseconds per token at a
49,152-token vocabulary, and it names the JSON-schema keywords it cannot enforce instead of
ignoring them. xgrammar was as fast per mask but needs torch, transformers, triton (a 286 MB
wheel) and apache-tvm-ffi.

For training, ``replay`` runs the grammar over a recorded completion again and gives the same
bitmasks the sampler used, so the trainer's log-probs use the same masked distribution: masks are
rebuilt where needed, never stored (a 49,152-token mask is 6 KiB a position).

A position where the grammar allowed exactly one token carried no choice: its recorded log-prob is
0 and the trainer gives it no loss (``agl.train.samples``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

if TYPE_CHECKING:
    from agl.policy.load import Policy

# Whitespace in the JSON a grammar allows: at most one space where JSON allows whitespace, so both
# json.dumps' style ({"a": 1, "b": 2}) and the compact one ({"a":1,"b":2}) are the model's to choose,
# but not free whitespace, newlines included, on which a small model can loop until max_tokens.
JSON_STYLE = {"whitespace_flexible": True, "whitespace_pattern": "[ ]?"}

_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]: bit b of byte value x
_BIAS_LUT = torch.where(_BITS.bool(), 0.0, float("-inf"))  # byte -> its 8 tokens' additive mask
_POPCOUNT = _BITS.sum(-1)  # [256]


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``_BIAS_LUT`` (float32) and ``_POPCOUNT`` on ``device``, copied there once (on the CPU: themselves)."""
    return _BIAS_LUT.to(device, torch.float32), _POPCOUNT.to(device)


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A grammar a sequence's tokens must follow: llguidance's grammar text, and what it is for
    (``kind``: "json_schema", "json_object", "tool_calls"; recorded with the span)."""

    text: str
    kind: str

    @classmethod
    def json_schema(cls, schema: dict, kind: str = "json_schema") -> Grammar:
        return cls(llguidance.LLMatcher.grammar_from_json_schema(with_style(schema)), kind)

    @classmethod
    def lark(cls, text: str, kind: str) -> Grammar:
        return cls(llguidance.LLMatcher.grammar_from_lark(text), kind)


def with_style(schema: dict) -> dict:
    """``schema`` with ``JSON_STYLE`` as its llguidance options (the schema's own options win)."""
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    return {**schema, "x-guidance": {**JSON_STYLE, **own}}


def lark_json(schema: dict) -> str:
    """``schema`` as a Lark ``%json`` item, for grammars that embed JSON in other text."""
    return "%json " + json.dumps(with_style(schema), ensure_ascii=False)


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` (a fast HF tokenizer), masks ``vocab_size`` wide (the
    logits' width), the grammar's end being any of ``eos_token_ids``. Built once per tokenizer
    (~0.4 s), then cached."""
    key = (vocab_size, tuple(eos_token_ids))
    cached = _TOKENIZERS.setdefault(tokenizer, {})
    if key not in cached:
        cached[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    return cached[key]


def policy_grammar_tokenizer(policy: Policy) -> llguidance.LLTokenizer:
    """``grammar_tokenizer`` for a ``Policy``: its tokenizer, the model's vocabulary width, its eos ids."""
    vocab = int(policy.model.config.vocab_size)
    return grammar_tokenizer(policy.tokenizer, vocab, policy.eos_token_ids)


_COMPILED_MAX = 256  # grammars kept compiled: an agent sends the same schema call after call


def _compiled(text: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher of ``text`` (in error if it does not compile), copied from one compiled once:
    compiling costs ~1 ms for a small schema, far more for a large one, a copy ~0.05 ms."""
    # keyed by id, the tokenizer held with its matchers so that its id is never reused (llguidance's
    # tokenizers take no weak references); there are as many as processes use tokenizers: one or two
    _, per_tokenizer = _MATCHERS.setdefault(id(tokenizer), (tokenizer, collections.OrderedDict()))
    pristine = per_tokenizer.get(text)
    if pristine is None:
        pristine = per_tokenizer[text] = llguidance.LLMatcher(tokenizer, text, log_level=0)
        while len(per_tokenizer) > _COMPILED_MAX:
            per_tokenizer.popitem(last=False)
    per_tokenizer.move_to_end(text)
    return pristine.deep_copy()


_MATCHERS: dict[int, tuple[llguidance.LLTokenizer, collections.OrderedDict]] = {}


def check(grammar: Grammar, tokenizer: llguidance.LLTokenizer) -> str:
    """'' when ``grammar`` compiles, else llguidance's reason (it names unsupported schema keywords:
    'Unimplemented keys: ["uniqueItems"]')."""
    matcher = _compiled(grammar.text, tokenizer)
    return matcher.get_error() if matcher.is_error() else ""


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, grammar: Grammar, tokenizer: llguidance.LLTokenizer):
        self.grammar = grammar
        self.matcher = _compiled(grammar.text, tokenizer)
        if self.matcher.is_error():
            raise ValueError(f"the grammar does not compile: {self.matcher.get_error()}")

    def fill(self, bitmask_W: torch.Tensor) -> None:
        """Write the allowed next tokens into ``bitmask_W`` (int32, one bit per token)."""
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask_W[None], 0)

    def consume(self, token: int) -> bool:
        """Advance past ``token``; False (and the matcher in error) if the grammar did not allow it."""
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def mask_bias(bitmask_RW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The additive mask of each bitmask row: 0 where the token is allowed, -inf elsewhere. [R, V]

    One table lookup per byte of the bitmask (a gather of 8 floats), not a bit shift per token.
    """
    bytes_RB = bitmask_RW.contiguous().view(torch.uint8).long()
    bias_lut, _ = _tables(bytes_RB.device)
    bias = torch.nn.functional.embedding(bytes_RB, bias_lut)  # [R, W*4, 8], on the mask's device
    return bias.reshape(bitmask_RW.shape[0], -1)[:, :vocab_size]


def allowed_counts(bitmask_RW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How many of the first ``vocab_size`` tokens each bitmask row allows. [R]"""
    full, rest = divmod(vocab_size, 8)
    bytes_RB = bitmask_RW.contiguous().view(torch.uint8)
    _, popcount = _tables(bytes_RB.device)
    counts = popcount[bytes_RB[:, :full].long()].sum(-1)
    if rest:
        counts += popcount[(bytes_RB[:, full] & ((1 << rest) - 1)).long()]
    return counts


def replay(grammar_text: str, tokens: Sequence[int], tokenizer: llguidance.LLTokenizer) -> torch.Tensor:
    """The bitmask the grammar gave before each of ``tokens``, as the sampler saw it. [T, W] int32

    Raises ValueError if the tokens do not follow the grammar (they were not sampled under it).
    """
    state = GrammarState(Grammar(grammar_text, "replay"), tokenizer)
    bitmask_TW = torch.empty((len(tokens), bitmask_words(tokenizer.vocab_size)), dtype=torch.int32)
    for t, token in enumerate(tokens):
        state.fill(bitmask_TW[t])
        if not state.consume(int(token)):
            raise ValueError(f"token {t} ({token}) does not follow the recorded grammar: {state.error}")
    return bitmask_TW
