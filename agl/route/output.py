"""Sampled tokens to the text a client gets: incremental UTF-8-safe decoding, stop tokens and stop strings,
and the hold-back that streaming needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from agl.route.rendering import decode

# ----------------------------------------------------------------------------- output text


class IncrementalDecoder:
    """Decodes a growing token list into text pieces, never splitting a UTF-8 character.

    A byte-level token can hold half of a multi-byte character; its text is withheld
    (decode gives U+FFFD) until the next token completes it. Decoding from the last
    emitted boundary keeps each step O(1) rather than O(length).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already emitted; context for the next piece
        self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        before = decode(self.tokenizer, self.ids[self._prefix : self._read])
        after = decode(self.tokenizer, self.ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]


@dataclasses.dataclass
class Delta:
    """Text released to the client together with the tokens consumed since the last delta."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


class OutputAssembler:
    """Sampled tokens of one choice -> the text returned to the client.

    - A stop token (eos, unless ``ignore_eos``) ends the text and adds none of its own.
    - A stop string ends the text just before it; the caller then cancels the sequence.
      ``token_ids`` end at the token that completed the match (later tokens were never seen).
    - For streaming, text that might be the start of a stop string is held back until it
      is clear it is not.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop_strings: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        top_logprobs: bool = False,
    ):
        self.decoder = IncrementalDecoder(tokenizer)
        self.stop_strings = list(stop_strings)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.holdback = max((len(s) for s in self.stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if top_logprobs else None
        self.text = ""
        self.stop_matched: str | None = None
        self.ended_on_stop_token = False
        self._released_chars = 0
        self._released_tokens = 0

    @property
    def finished(self) -> bool:
        return self.stop_matched is not None or self.ended_on_stop_token

    def add(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        """Take one sampled token (ignored once finished)."""
        if self.finished:
            return
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        if self.top_logprobs is not None:
            self.top_logprobs.append(list(top or []))
        if token_id in self.stop_token_ids:
            self.ended_on_stop_token = True
            self._append(self.decoder.flush())
        else:
            self._append(self.decoder.push(token_id))

    def _append(self, piece: str) -> None:
        start = max(0, len(self.text) - self.holdback)  # a stop string may straddle old and new text
        self.text += piece
        if self.stop_strings:
            self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        hits = [(pos, s) for s in self.stop_strings if (pos := self.text.find(s, start)) >= 0]
        if hits:
            pos, stop = min(hits)
            self.text = self.text[:pos]
            self.stop_matched = stop

    def finish(self) -> None:
        """The sequence ended (length, abort): decode any withheld partial character."""
        if not self.finished:
            self._append(self.decoder.flush())

    def release(self, final: bool = False) -> Delta:
        """Text not yet handed out, with the tokens consumed since the last release.

        While running, a possible stop-string start is kept back, and tokens that add no
        text yet (half a character, held-back text) wait for the delta that shows their text.
        """
        end = len(self.text) if (final or self.finished) else max(self._released_chars, len(self.text) - self.holdback)
        text = self.text[self._released_chars : end]
        if not text and not final:
            return Delta("", [], [], [] if self.top_logprobs is not None else None)
        tokens = slice(self._released_tokens, len(self.token_ids))
        delta = Delta(
            text,
            self.token_ids[tokens],
            self.logprobs[tokens],
            self.top_logprobs[tokens] if self.top_logprobs is not None else None,
        )
        self._released_chars, self._released_tokens = end, len(self.token_ids)
        return delta
