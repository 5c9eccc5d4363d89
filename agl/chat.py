"""Chat logic of the model route, free of HTTP: prompt rendering with exact prefix reuse,
turning sampled tokens into returned text (stop strings, streaming), and tool-call parsing.

Prefix reuse, and why: an agent sends the whole conversation on every call, including the
model's earlier replies as text. Re-tokenizing a reply can give different ids than were
sampled (" " + "hello" sampled, " hello" re-encoded), so the trainer would see a prompt the
policy never produced. ``render_prompt`` therefore starts the prompt with an earlier call's
exact prompt + response ids whenever the rendered conversation text starts with their
decoded text, and tokenizes only the rest.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

from agl.config import ServerConfig
from agl.openai_schema import Message

DECODE = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Exact text of ``ids``, special tokens included: what the policy actually wrote."""
    return tokenizer.decode(list(ids), **DECODE)


# ----------------------------------------------------------------------------- rendering


def template_messages(messages: Iterable[Message]) -> list[dict]:
    """Messages as chat templates expect them: string content, tool-call arguments as objects.

    Hugging Face templates take ``arguments`` as a dict (they ``tojson`` it); arguments that
    are not valid JSON are passed through as the string the client sent. A ``developer``
    message (OpenAI's newer name for instructions) is a ``system`` message to the template.
    """
    out = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": message.text()}
        if message.name:
            item["name"] = message.name
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": json_or_str(call.function.arguments)}}
                for call in message.tool_calls
            ]
        out.append(item)
    return out


def json_or_str(text: str) -> Any:
    """``text`` parsed as JSON, or itself when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclasses.dataclass
class Turn:
    """One earlier call of an attempt: its exact prompt and sampled response ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    prompt_text: str  # decode(prompt_ids), kept to avoid decoding it again on every later call
    reply_text: str = ""  # the text the reply was parsed from: forced tokens' text + returned text


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    reused: int  # leading ids taken verbatim from an earlier call (0: rendered from scratch)


class History:
    """Recent turns per attempt, bounded both in attempts (LRU) and in turns per attempt.

    Only attempts still talking to the route need their turns; an evicted attempt falls
    back to its spans in the store. The choices of one call share their prompt lists.
    """

    def __init__(self, max_attempts: int = ServerConfig.history_attempts, turns_per_attempt: int = ServerConfig.history_turns):
        self.max_attempts = max_attempts
        self.turns_per_attempt = turns_per_attempt
        self._attempts: collections.OrderedDict[Any, collections.deque[Turn]] = collections.OrderedDict()

    def get(self, key: Any) -> list[Turn] | None:
        turns = self._attempts.get(key)
        if turns is None:
            return None
        self._attempts.move_to_end(key)
        return list(turns)

    def add(self, key: Any, turn: Turn) -> None:
        turns = self._attempts.get(key)
        if turns is None:
            turns = self._attempts[key] = collections.deque(maxlen=self.turns_per_attempt)
        turns.append(turn)
        self._touch(key)

    def load(self, key: Any, turns: Iterable[Turn]) -> None:
        """Set the turns of an attempt not in memory (e.g. read back from its spans); may be empty."""
        self._attempts[key] = collections.deque(turns, maxlen=self.turns_per_attempt)
        self._touch(key)

    def _touch(self, key: Any) -> None:
        self._attempts.move_to_end(key)
        while len(self._attempts) > self.max_attempts:
            self._attempts.popitem(last=False)

    def __contains__(self, key: Any) -> bool:
        return key in self._attempts


def render_prompt(policy: Any, messages: list[dict], tools: list[dict] | None, turns: Sequence[Turn] = ()) -> Prompt:
    """Prompt ids for ``messages``, extending the earlier turn that covers most of it exactly.

    Without a matching turn this is ``policy.render_chat`` from scratch. Template errors
    (e.g. roles that must alternate) propagate to the caller as the client's fault.
    """
    if turns:
        tokenizer = policy.tokenizer
        kwargs = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        best: tuple[list[int], int] | None = None  # (prefix ids, characters of text they cover)
        for turn in turns:
            match = _match_turn(tokenizer, turn, text)
            if match and (best is None or len(match[0]) > len(best[0])):
                best = match
        if best is not None:
            prefix, covered = best
            suffix = tokenizer.encode(text[covered:], add_special_tokens=False) if covered < len(text) else []
            return Prompt(prefix + suffix, len(prefix))
    return Prompt(policy.render_chat(messages, tools=tools), 0)


def _match_turn(tokenizer: Any, turn: Turn, text: str) -> tuple[list[int], int] | None:
    """The longest ``prompt + response[:k]`` of ``turn`` whose decoded text starts ``text``.

    Usually k is the whole response (its text came back verbatim as the assistant message,
    eos included via the template's closing tag). A stop string, or a template that
    re-renders tool calls differently, makes only part of the response line up; then the
    largest such k is found by bisection (the prefix property is monotone in k).
    """
    if not text.startswith(turn.prompt_text):
        return None
    rest = text[len(turn.prompt_text):]
    response = turn.response_ids

    def covers(k: int) -> bool:
        return rest.startswith(decode(tokenizer, response[:k]))

    if covers(len(response)):
        k = len(response)
    else:
        lo, hi = 0, len(response)  # covers(lo) holds, covers(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if covers(mid) else (lo, mid)
        k = lo
    ids = turn.prompt_ids + response[:k]
    covered = decode(tokenizer, ids)
    if not text.startswith(covered):  # tokenizers whose decode is not concatenative (e.g. leading spaces)
        return None
    return ids, len(covered)


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
        before = decode(self.tokenizer, self.ids[self._prefix:self._read])
        after = decode(self.tokenizer, self.ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]


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

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = (), stop_token_ids: Iterable[int] = (), top_logprobs: bool = False):
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
        text = self.text[self._released_chars:end]
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


# ----------------------------------------------------------------------------- tool calls

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# A call's JSON up to the first character of its arguments. Once this much has arrived the call
# is announced (id, name) and its arguments stream as they are written; the lookahead makes the
# match, and so everything after it, the same however the text was cut into pieces.
CALL_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
# What may still be the close of the call's object rather than its arguments: held back.
CALL_TAIL = re.compile(r"\s*\}?\s*\Z")


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split Hermes/Qwen-style ``<tool_call>{"name": .., "arguments": ..}</tool_call>`` blocks
    out of ``text`` (``ToolCallParser`` fed the whole text at once).

    Returns (content, tool_calls) in OpenAI's shape; ``content`` is the remaining text
    (None if only whitespace). A block that is no call stays in the content: the client sees
    what the model wrote.

    >>> content, [call] = parse_tool_calls('Sure.<tool_call>\\n{"name": "add", "arguments": {"a":1}}\\n</tool_call>')
    >>> content, call["function"]
    ('Sure.', {'name': 'add', 'arguments': '{"a":1}'})
    """
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls


class ToolCallParser:
    """Hermes tool calls out of text that arrives in pieces, as OpenAI-style stream deltas.

    ``feed`` and ``finish`` return the deltas the text so far makes certain: ``{"content": ..}``
    and ``{"tool_calls": [..]}``; a call comes first as ``{index, id, type, function: {name,
    arguments: ""}}``, then as argument fragments, as OpenAI streams them. However the text is
    cut, the deltas add up to the same ``content`` and ``calls`` (the non-streaming response).

    Rules (a block is ``<tool_call>`` .. ``</tool_call>``):
      - a block whose JSON starts ``{"name": "<name>", "arguments": `` is a call from then on:
        a stream cannot take back what it sent. Its arguments are the model's own text up to
        the object's closing brace, valid JSON or not (OpenAI's may be invalid too); arguments
        written as a JSON string are returned decoded. The block may end unclosed (length).
      - any other closed block is a call if its body is a JSON object with a string ``name``
        (its arguments re-serialized), else it stays in the content as written;
      - the content is the text outside calls, stripped of surrounding whitespace.
    """

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._content: list[str] = []  # content released so far
        self._blank = ""  # trailing whitespace held back: content only if more content follows
        self._buffer = ""  # text not consumed yet (it may be the start of a tag)
        self._in_block = False
        self._body = ""  # the open block's text so far
        self._args_at: int | None = None  # where the open call's arguments start in _body
        self._args_sent = 0
        self.cut_in_call = False  # the text ended inside a call: its arguments may be incomplete

    @property
    def content(self) -> str | None:
        return "".join(self._content) or None

    def feed(self, text: str) -> list[dict]:
        self._buffer += text
        return self._consume(final=False)

    def finish(self) -> list[dict]:
        """The text is complete: release what was held back, end an unclosed block."""
        deltas = self._consume(final=True)
        if self._in_block:
            self.cut_in_call = self._args_at is not None
            deltas += self._end_block(closed=False)
        return deltas

    def _consume(self, final: bool) -> list[dict]:
        deltas: list[dict] = []
        while True:
            tag = CLOSE_TAG if self._in_block else OPEN_TAG
            at = self._buffer.find(tag)
            end = at if at >= 0 else len(self._buffer) - (0 if final else _partial_tag(self._buffer, tag))
            piece, self._buffer = self._buffer[:end], self._buffer[end + (len(tag) if at >= 0 else 0):]
            if self._in_block:
                self._body += piece
                deltas += self._progress()
                if at >= 0:
                    deltas += self._end_block(closed=True)
            else:
                deltas += self._text(piece)
                if at >= 0:
                    self._in_block, self._body, self._args_at, self._args_sent = True, "", None, 0
            if at < 0:
                return deltas

    def _text(self, piece: str) -> list[dict]:
        if not self._content:
            piece = piece.lstrip()
        text = self._blank + piece
        kept = text.rstrip()
        self._blank = text[len(kept):]
        if not kept:
            return []
        self._content.append(kept)
        return [{"content": kept}]

    def _progress(self) -> list[dict]:
        """Announce the open block's call once its header is complete; stream its arguments."""
        deltas: list[dict] = []
        if self._args_at is None:
            match = CALL_HEADER.match(self._body)
            if match is None:
                return deltas
            try:
                name = json.loads(f'"{match.group(1)}"')
            except ValueError:
                return deltas
            self._args_at = match.end()
            deltas.append(self._announce(name))
        if not self._string_arguments:
            deltas += self._send_arguments(self._arguments())
        return deltas

    @property
    def _string_arguments(self) -> bool:
        return self._body[self._args_at] == '"'  # decoded at the end, so not streamed

    def _arguments(self) -> str:
        text = self._body[self._args_at:]
        return text[: CALL_TAIL.search(text).start()]

    def _announce(self, name: str) -> dict:
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"tool_calls": [{"index": len(self.calls) - 1, **call, "function": dict(call["function"])}]}

    def _send_arguments(self, arguments: str) -> list[dict]:
        fragment = arguments[self._args_sent:]
        if not fragment:
            return []
        self._args_sent = len(arguments)
        self.calls[-1]["function"]["arguments"] += fragment
        return [{"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]}]

    def _end_block(self, closed: bool) -> list[dict]:
        self._in_block = False
        if self._args_at is not None:
            arguments = self._arguments()
            if self._string_arguments:
                decoded = json_or_str(arguments)
                arguments = decoded if isinstance(decoded, str) else arguments
            return self._send_arguments(arguments)
        call = _tool_call(self._body) if closed else None
        if call is None:
            return self._text(OPEN_TAG + self._body + (CLOSE_TAG if closed else ""))
        return [self._announce(call["function"]["name"])] + self._send_arguments(call["function"]["arguments"])


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that may be the start of ``tag`` (kept back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _tool_call(body: str) -> dict | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": parsed["name"], "arguments": arguments}}
