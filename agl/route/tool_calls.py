"""Tool calls in a model's text: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks parsed
whole (``parse_tool_calls``) or while they stream (``ToolCallParser``).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any


def json_or_str(text: str) -> Any:
    """``text`` parsed as JSON, or itself when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# A call's JSON up to the first character of its arguments. Once this much has arrived the call
# is announced (id, name) and its arguments stream as they are written; the lookahead makes the
# match, and so everything after it, the same however the text was cut into pieces.
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
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
            piece, self._buffer = self._buffer[:end], self._buffer[end + (len(tag) if at >= 0 else 0) :]
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
        self._blank = text[len(kept) :]
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
        text = self._body[self._args_at :]
        return text[: CALL_TAIL.search(text).start()]

    def _announce(self, name: str) -> dict:
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        return {"tool_calls": [{"index": len(self.calls) - 1, **call, "function": dict(call["function"])}]}

    def _send_arguments(self, arguments: str) -> list[dict]:
        fragment = arguments[self._args_sent :]
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
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": parsed["name"], "arguments": arguments},
    }
