"""The response side of the OpenAI wire format: what the model route answers, as pydantic models.

Requests are parsed in ``agl.route.requests``; this is their other half. The shapes are the ones
the ``openai`` SDK (and LangChain, the Agents SDK, ...) parse, key for key: fields OpenAI always
sends are sent even when null (``"logprobs": null``), while fields marked ``Omitted`` (the
``return_token_ids`` extension's ``token_ids`` and ``prompt_token_ids``, a stream delta's absent
keys, a chunk's ``usage``) are left out when None. Each model knows its shape: serialize with a
plain ``model_dump()``, no exclude flags.

  - chat and text completions: ``ChatCompletion`` / ``ChatCompletionChunk``, ``Completion`` /
    ``CompletionChunk``, and ``Answer``, which writes them for one call, whole or streamed;
  - the Responses API: the ``Response`` object, its output items, and ``OutputBuilder``, which
    turns one reply's parsed deltas into those items and the stream events that build them.

Cost: a streamed chat chunk, built and serialized, takes longer as models than as the hand-built dict it replaced,
a small share of one core at the route's best rate (docs/benchmarks-history.md#route-response-models).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, Field, model_serializer

from agl.route.output import Delta
from agl.route.rendering import decode
from agl.route.requests import ToolCall

if TYPE_CHECKING:
    from agl.route.recording import Call, Choice

MIN_LOGPROB = -9999.0  # what OpenAI reports for impossible tokens; JSON has no -Infinity

T = TypeVar("T")
_OMIT = object()
Omitted = Annotated[Optional[T], _OMIT]  # a field left out of the JSON when None


class Wire(BaseModel):
    """A response object: dumps its ``Omitted`` fields only when they are set."""

    _omitted: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._omitted = frozenset(
            name for name, field in cls.model_fields.items() if any(m is _OMIT for m in field.metadata)
        )

    @model_serializer(mode="wrap")
    def _leave_out_omitted(self, handler: Any) -> dict:
        data = handler(self)
        for name in self._omitted:
            if data.get(name, 0) is None:
                del data[name]
        return data


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# ----------------------------------------------------------------------------- logprobs


class TopLogprob(Wire):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    """One sampled token (chat, and a Responses ``output_text`` part)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(Wire):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(Wire):
    """The legacy completions shape: parallel lists."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: Optional[list[dict[str, float]]]
    text_offset: list[int]


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _entry(tokenizer: Any, token_id: int, logprob: float) -> dict:
    text = decode(tokenizer, [token_id])
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def chat_logprobs(tokenizer: Any, delta: Delta) -> ChatLogprobs:
    """The tokens of ``delta`` in the chat shape, each with its alternatives (if asked for)."""
    tops = delta.top_logprobs or [[] for _ in delta.token_ids]
    return ChatLogprobs(
        content=[
            TokenLogprob(
                **_entry(tokenizer, tid, lp),
                top_logprobs=[TopLogprob(**_entry(tokenizer, alt, alp)) for alt, alp in top],
            )
            for tid, lp, top in zip(delta.token_ids, delta.logprobs, tops)
        ]
    )


def completion_logprobs(tokenizer: Any, delta: Delta, with_top: bool) -> CompletionLogprobs:
    texts = [decode(tokenizer, [t]) for t in delta.token_ids]
    tops = delta.top_logprobs or [[] for _ in delta.token_ids]
    offsets, position = [], 0
    for text in texts:
        offsets.append(position)
        position += len(text)
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[_finite(lp) for lp in delta.logprobs],
        top_logprobs=[{decode(tokenizer, [tid]): _finite(alp) for tid, alp in top} for top in tops]
        if with_top
        else None,
        text_offset=offsets,
    )


# ----------------------------------------------------------------------------- chat and text completions


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class ChatMessage(Wire):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: Omitted[list[ToolCall]] = None  # the request side's model: a call sent back comes back as it went


class FunctionDelta(Wire):
    name: Omitted[str] = None
    arguments: Omitted[str] = None


class ToolCallDelta(Wire):
    """A call announced (index, id, type, name, empty arguments), or a fragment of its arguments."""

    index: int
    id: Omitted[str] = None
    type: Omitted[Literal["function"]] = None
    function: FunctionDelta


class ChatDelta(Wire):
    role: Omitted[Literal["assistant"]] = None
    content: Omitted[str] = None
    tool_calls: Omitted[list[ToolCallDelta]] = None


class ChatChoice(Wire):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]
    token_ids: Omitted[list[int]] = None


class ChatChunkChoice(Wire):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[str]
    token_ids: Omitted[list[int]] = None


class TextChoice(Wire):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[str]
    token_ids: Omitted[list[int]] = None


class _Object(Wire):
    id: str
    object: str
    created: int
    model: str


class ChatCompletion(_Object):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: Omitted[list[int]] = None


class ChatCompletionChunk(_Object):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_token_ids: Omitted[list[int]] = None  # on the first chunk of choice 0
    choices: list[ChatChunkChoice]
    usage: Omitted[Usage] = None  # on the last chunk (no choices), with stream_options.include_usage


class Completion(_Object):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage
    prompt_token_ids: Omitted[list[int]] = None


class CompletionChunk(_Object):
    object: Literal["text_completion"] = "text_completion"
    prompt_token_ids: Omitted[list[int]] = None
    choices: list[TextChoice]
    usage: Omitted[Usage] = None


class ModelCard(Wire):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "agl"
    max_model_len: int


class ModelList(Wire):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Answer:
    """The answer to one chat or text completion call: the whole object once the call is done,
    or the chunks of its stream as it goes.

    A chat choice parsed for tool calls streams one chunk per parser delta (content, a call, an
    argument fragment); the tokens consumed so far travel with the first. Tokens whose text the
    parser still holds back wait for the next chunk, or for the choice's last one.
    """

    def __init__(self, call: Call, model: str, tokenizer: Any):
        self.call = call
        self.chat = call.kind == "chat"
        self.tokenizer = tokenizer
        self.with_ids = call.req.return_token_ids
        self.head = {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + call.id,
            "created": int(call.received_wall),
            "model": model,
        }
        self._held: dict[int, Delta] = {}  # per choice: tokens whose text the tool parser holds back

    def usage(self) -> Usage:
        return Usage.of(len(self.call.prompt_ids), self.call.completion_tokens)

    def whole(self) -> ChatCompletion | Completion:
        choices = []
        for choice in self.call.choices:
            out = choice.out
            common = self._common(
                choice, Delta(choice.content or "", out.token_ids, out.logprobs, out.top_logprobs), choice.finish_reason
            )
            if self.chat:
                choices.append(
                    ChatChoice(
                        message=ChatMessage(content=choice.content, tool_calls=choice.tool_calls or None), **common
                    )
                )
            else:
                choices.append(TextChoice(text=out.text, **common))
        prompt_ids = self.call.prompt_ids if self.with_ids else None
        return (ChatCompletion if self.chat else Completion)(
            **self.head, choices=choices, usage=self.usage(), prompt_token_ids=prompt_ids
        )

    def opening(self, choice: Choice) -> ChatCompletionChunk | CompletionChunk:
        return self._chunk(choice, None, None)

    def chunks(
        self, choice: Choice, tokens: Delta, parsed: list[dict] | None = None
    ) -> list[ChatCompletionChunk | CompletionChunk]:
        """The chunks of ``tokens``: one, or one per delta the tool parser ``parsed`` from their text."""
        if choice.tools is None:
            return [self._chunk(choice, tokens, None)]
        held = self._held.pop(choice.index, None)
        tokens = tokens if held is None else _joined(held, tokens)
        if not parsed:
            self._held[choice.index] = tokens
            return []
        return [
            self._chunk(choice, tokens if i == 0 else _no_tokens(tokens), None, message)
            for i, message in enumerate(parsed)
        ]

    def last(self, choice: Choice, final: Delta) -> ChatCompletionChunk | CompletionChunk:
        """A choice's last chunk, with its finish reason (parsed: an empty delta, with the tokens held back)."""
        if choice.tools is None:
            return self._chunk(choice, final, choice.finish_reason)
        return self._chunk(
            choice, self._held.pop(choice.index, None) or _no_tokens(final), choice.finish_reason, message={}
        )

    def usage_chunk(self) -> ChatCompletionChunk | CompletionChunk:
        return (ChatCompletionChunk if self.chat else CompletionChunk)(**self.head, choices=[], usage=self.usage())

    def _chunk(
        self, choice: Choice, tokens: Delta | None, finish_reason: str | None, message: dict | None = None
    ) -> ChatCompletionChunk | CompletionChunk:
        """``tokens=None``: the opening chunk of a choice. ``message``: the chat delta, if not
        ``{"content": tokens.text}``."""
        common = self._common(choice, tokens, finish_reason)
        prompt_ids = self.call.prompt_ids if self.with_ids and tokens is None and choice.index == 0 else None
        if not self.chat:
            return CompletionChunk(
                **self.head,
                prompt_token_ids=prompt_ids,
                choices=[TextChoice(text=tokens.text if tokens else "", **common)],
            )
        if tokens is None:
            delta = ChatDelta(role="assistant", content="")
        else:
            delta = ChatDelta(content=tokens.text) if message is None else ChatDelta.model_validate(message)
        return ChatCompletionChunk(
            **self.head, prompt_token_ids=prompt_ids, choices=[ChatChunkChoice(delta=delta, **common)]
        )

    def _common(self, choice: Choice, tokens: Delta | None, finish_reason: str | None) -> dict:
        """A choice's fields besides its text: logprobs of ``tokens`` (if asked for), finish reason, token ids."""
        logprobs = None
        if tokens is not None and self.call.req.wants_logprobs:
            with_top = bool(self.call.req.n_top_logprobs)
            logprobs = (
                chat_logprobs(self.tokenizer, tokens)
                if self.chat
                else completion_logprobs(self.tokenizer, tokens, with_top)
            )
        token_ids = (tokens.token_ids if tokens else []) if self.with_ids else None
        return {"index": choice.index, "logprobs": logprobs, "finish_reason": finish_reason, "token_ids": token_ids}


def _joined(first: Delta, then: Delta) -> Delta:
    tops = None if first.top_logprobs is None else first.top_logprobs + (then.top_logprobs or [])
    return Delta(first.text + then.text, first.token_ids + then.token_ids, first.logprobs + then.logprobs, tops)


def _no_tokens(like: Delta) -> Delta:
    return Delta("", [], [], None if like.top_logprobs is None else [])


# ----------------------------------------------------------------------------- the Responses API


class OutputText(Wire):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class OutputMessage(Wire):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(Wire):
    id: str
    type: Literal["function_call"] = "function_call"
    status: str = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = Union[OutputMessage, OutputFunctionCall]


class ResponseUsage(Wire):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0, "cache_write_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> ResponseUsage:
        return cls(
            input_tokens=prompt_tokens, output_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
        )


class IncompleteDetails(Wire):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class Response(Wire):
    """The ``response`` object (``openai.types.responses.Response``); the request's settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    completed_at: Optional[int] = None
    error: None = None
    incomplete_details: Optional[IncompleteDetails] = None
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    max_tool_calls: Optional[int]
    metadata: dict[str, str]
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: Optional[str]
    reasoning: None = None
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_logprobs: Optional[int]
    top_p: float
    truncation: str
    usage: Optional[ResponseUsage] = None
    user: None = None


class _ItemEvent(Wire):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _TextEvent(Wire):
    """``response.content_part.added`` / ``.done`` (``part``), ``response.output_text.delta``
    (``delta``, ``logprobs``) and ``.done`` (``text``, ``logprobs``)."""

    type: str
    item_id: str
    output_index: int
    content_index: int = 0
    part: Omitted[OutputText] = None
    delta: Omitted[str] = None
    text: Omitted[str] = None
    logprobs: Omitted[list[TokenLogprob]] = None


class _ArgumentsEvent(Wire):
    """``response.function_call_arguments.delta`` (``delta``) and ``.done`` (``name``, ``arguments``)."""

    type: str
    item_id: str
    output_index: int
    delta: Omitted[str] = None
    name: Omitted[str] = None
    arguments: Omitted[str] = None


class DeletedResponse(Wire):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class ResponseEvent(Wire):
    """``response.created`` / ``in_progress`` / ``completed`` / ``incomplete``: the whole response."""

    type: str
    response: Response


class ErrorEvent(Wire):
    type: Literal["error"] = "error"
    code: Optional[str]
    message: str
    param: Optional[str]


class ErrorDetail(Wire):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(Wire):
    """Every error the route answers, in OpenAI's shape (``agl.route.requests.error_body``)."""

    error: ErrorDetail


class Health(Wire):
    """``GET /health``: the route is up; the policy version it samples and the engine's load."""

    status: Literal["ok"]
    model: str
    policy_version: int
    running: int
    waiting: int


class OutputBuilder:
    """One reply's parsed deltas -> Responses output items, and the stream events that build them.

    ``feed`` takes what ``agl.route.tool_calls.ToolCallParser`` returns (``{"content": ..}`` and
    ``{"tool_calls": [..]}`` deltas; a reply parsed for no tools is all content) together with
    the sampled tokens they came from, and returns events as dicts (without ``sequence_number``);
    the non-streamed response's output is ``output`` (``items``: as dicts) after ``finish``.
    Tokens go with the first text they released (their logprobs, if asked for, with it); tokens
    that wrote only a call have no place in the Responses shape.
    """

    def __init__(self, logprobs: Callable[[Delta], list[TokenLogprob]] | None = None):
        self.output: list[OutputItem] = []
        self._logprobs = logprobs  # tokens -> output_text logprob entries
        self._open: OutputItem | None = None  # the item still being written
        self._pending: list[TokenLogprob] = []  # logprobs of tokens whose text is not out yet

    @property
    def items(self) -> list[dict]:
        return [item.model_dump() for item in self.output]

    def feed(self, deltas: list[dict], tokens: Delta | None = None) -> list[dict]:
        if self._logprobs is not None and tokens is not None and tokens.token_ids:
            self._pending += self._logprobs(tokens)
        if not deltas:
            return []
        events: list[dict] = []
        for delta in deltas:
            if delta.get("content"):
                events += self._text(delta["content"], self._pending)
                self._pending = []
            for call in delta.get("tool_calls") or []:
                if "id" in call:
                    events += self._open_call(call["id"], call["function"]["name"])
                if call["function"].get("arguments"):
                    events += self._arguments(call["function"]["arguments"])
        self._pending = []  # tokens that wrote a call (or nothing the client sees)
        return events

    def finish(self, incomplete: bool) -> list[dict]:
        """The reply ended (``incomplete``: cut by the token limit). An empty reply is an empty message."""
        events = [] if self.output else self._open_message()
        return events + self._close("incomplete" if incomplete else "completed")

    # Events are dumped when made: an item changes after the event that announced it.

    def _index(self) -> int:
        return len(self.output) - 1

    def _text(self, text: str, logprobs: list[TokenLogprob]) -> list[dict]:
        events = [] if isinstance(self._open, OutputMessage) else self._close() + self._open_message()
        part = self._open.content[0]
        part.text += text
        if self._logprobs is not None:
            part.logprobs += logprobs
        head = {"item_id": self._open.id, "output_index": self._index()}
        return events + [
            _TextEvent(
                type="response.output_text.delta", **head, delta=text, logprobs=logprobs if self._logprobs else []
            ).model_dump()
        ]

    def _open_message(self) -> list[dict]:
        item = self._opened(OutputMessage(id=new_id("msg")))
        added = _ItemEvent(type="response.output_item.added", output_index=self._index(), item=item).model_dump()
        item.content.append(OutputText())
        part = _TextEvent(
            type="response.content_part.added", item_id=item.id, output_index=self._index(), part=item.content[0]
        )
        return [added, part.model_dump()]

    def _open_call(self, call_id: str, name: str) -> list[dict]:
        events = self._close()
        item = self._opened(OutputFunctionCall(id=new_id("fc"), call_id=call_id, name=name))
        return events + [
            _ItemEvent(type="response.output_item.added", output_index=self._index(), item=item).model_dump()
        ]

    def _opened(self, item: OutputItem) -> OutputItem:
        self.output.append(item)
        self._open = item
        return item

    def _arguments(self, fragment: str) -> list[dict]:
        self._open.arguments += fragment
        event = _ArgumentsEvent(
            type="response.function_call_arguments.delta",
            item_id=self._open.id,
            output_index=self._index(),
            delta=fragment,
        )
        return [event.model_dump()]

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        head = {"item_id": item.id, "output_index": self._index()}
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events: list[Wire] = [
                _TextEvent(type="response.output_text.done", **head, text=part.text, logprobs=part.logprobs),
                _TextEvent(type="response.content_part.done", **head, part=part),
            ]
        else:
            events = [
                _ArgumentsEvent(
                    type="response.function_call_arguments.done", **head, name=item.name, arguments=item.arguments
                )
            ]
        events.append(_ItemEvent(type="response.output_item.done", output_index=self._index(), item=item))
        return [event.model_dump() for event in events]
