"""OpenAI's Responses API (``POST /v1/responses``) as a translation of the chat route, free of HTTP.

The Agents SDK's default model (``OpenAIResponsesModel``) and ``client.responses.create`` speak
this API. A Responses request becomes the chat pipeline's own request (``to_chat_request``), so
rendering (the built-in tool prompt included), engine submission, ``tool_choice`` enforcement,
tool-call parsing and recording are the chat route's, and its span is an ``llm.chat`` span like
any other: multi-turn Responses conversations merge into one training sequence the same way.
The reply comes back as a ``Response`` with output items (``agl.route.response_models``: the objects, and
the ``OutputBuilder`` that writes its items and stream events), streamed or not.

Translation, item by item (``chat_messages``):
  - ``instructions`` -> a system message first; ``input`` as a string -> one user message;
  - a ``message`` item (``input_text`` / ``output_text`` / ``refusal`` parts, or a string) ->
    a message of its role (``developer`` is ``system`` to the template, as in chat);
  - consecutive assistant items (``message`` and ``function_call``) -> ONE assistant message:
    its text joined, its calls in order. That is what one model reply was, so the route finds
    the reply's exact sampled tokens again and the prefix holds;
  - ``function_call_output`` -> a ``tool`` message (its ``call_id`` must answer an earlier call);
  - ``reasoning`` items are dropped (this route never makes them; they carry no text to render).
  Anything else (images, files, ``item_reference``, built-in tool calls) is a 400.

``previous_response_id``: responses with ``store`` (the default) are kept in memory
(``agl.route.recording.ResponseStore``: the most recent ``max_responses``), each with its whole
conversation (input items before it included, instructions not: as OpenAI, a follow-up's own
``instructions`` apply). A response is found only from the route it was made on (the same
rollout attempt, or unscoped ``/v1``).

Output (``agl.route.response_models.OutputBuilder``): the reply's text is a ``message`` item with one
``output_text`` part; each parsed tool call is a ``function_call`` item (``call_id`` as chat's
tool-call id). Text after a call opens a new message item, so streamed and non-streamed outputs
are the same items; sent back as input, they become the one assistant message they came from.
A reply cut by ``max_output_tokens`` makes the response (and its last item) ``incomplete``.
Logprobs (``include: ["message.output_text.logprobs"]``) cover the tokens that wrote the text;
the span has every sampled token's.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agl.route.requests import (
    MAX_SEED,
    MAX_TOP_LOGPROBS,
    APIError,
    ChatCompletionRequest,
    FunctionDef,
    Temperature,
    Tool,
    _Lenient,
    bad_request,
    text_only,
    tool_choice_shape,
    validation_error,
)
from agl.route.response_models import IncompleteDetails, OutputItem, Response, ResponseUsage

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS = 16
SUPPORTED_ITEMS = "'message', 'function_call', 'function_call_output' (and 'reasoning', ignored)"


# ----------------------------------------------------------------------------- request


TEXT_ONLY = text_only("input_text", "output_text", "refusal")


class TextPart(_Lenient):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Lenient):
    type: Literal["refusal"]
    refusal: str


Part = Union[TextPart, RefusalPart]


def _joined(content: Union[str, list]) -> str:
    """Parts' text joined without separator, as the chat route joins text parts."""
    if isinstance(content, str):
        return content
    return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in content)


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[Union[str, list[Part]], TEXT_ONLY]

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = "{}"  # JSON text, as the model wrote it

    @field_validator("arguments", mode="before")
    @classmethod
    def _dict_to_json(cls, value: Any) -> Any:  # some clients send the parsed object
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else value


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Annotated[Union[str, list[TextPart]], TEXT_ONLY]

    def text(self) -> str:
        return _joined(self.output)


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class FunctionTool(_Lenient):
    """The Responses shape of a function tool: name, description and parameters at top level."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    def chat(self) -> Tool:
        return Tool(
            type="function",
            function=FunctionDef(
                name=self.name, description=self.description, parameters=self.parameters, strict=self.strict
            ),
        )


class FunctionChoice(_Lenient):
    """``{"type": "function", "name": ...}``: a ``tool_choice``, or one of its allowed tools."""

    type: Literal["function"]
    name: str = Field(min_length=1)


class AllowedToolsChoice(_Lenient):
    """``{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", "name": ..}]}``."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[FunctionChoice] = Field(min_length=1)


class TextFormat(_Lenient):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "name", "schema", "strict", "description"}`` (the chat route's ``response_format``, flattened)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        if self.json_schema is None:
            raise bad_request("text.format.schema: a json_schema format needs 'schema'.", param="text.format.schema")
        spec = {"name": self.name or "response", "schema": self.json_schema, "strict": self.strict}
        if self.description is not None:
            spec["description"] = self.description
        return {"type": "json_schema", "json_schema": spec}


class TextOptions(_Lenient):
    """``text``: its ``format`` is honoured; ``verbosity`` is ignored (no reasoning model here)."""

    format: Optional[TextFormat] = None
    verbosity: Optional[str] = None


def _something_to_respond_to(schema: dict) -> None:
    """``to_chat_request``'s check in JSON schema terms (the route's OpenAPI document, ``agl.route.openapi``)."""
    schema["anyOf"] = [
        {"properties": {"input": {"type": ["string", "array"], "minItems": 1}}, "required": ["input"]},
        {"properties": {"instructions": {"type": "string"}}, "required": ["instructions"]},
    ]


class ResponsesRequest(_Lenient):
    """``POST /v1/responses``. Fields OpenAI accepts that change nothing here (``user``,
    ``reasoning``, ``truncation``, ``prompt_cache_key``, ``service_tier``, ``safety_identifier``,
    ``stream_options``, ``text.verbosity`` ...) are accepted and ignored; ones that would change the
    answer and cannot be honoured (``background``, ``conversation``, ``prompt``) are a 400.
    ``text.format``, ``parallel_tool_calls`` and ``max_tool_calls`` are honoured (a grammar,
    agl.route.structure)."""

    model_config = ConfigDict(json_schema_extra=_something_to_respond_to)
    model: Optional[str] = None
    input: Union[str, list[Any], None] = None  # items are parsed by parse_items (params name their index)
    instructions: Optional[str] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], FunctionChoice, AllowedToolsChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[Temperature] = None
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    include: Optional[list[str]] = None
    stream: Optional[bool] = False
    store: Optional[bool] = True
    previous_response_id: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    text: Optional[TextOptions] = None
    max_tool_calls: Optional[int] = Field(default=None, ge=1)
    truncation: Optional[Literal["auto", "disabled"]] = None
    background: Optional[bool] = Field(default=None, json_schema_extra={"enum": [False, None]})  # refused below
    conversation: Any = Field(default=None, json_schema_extra={"type": "null"})
    prompt: Any = Field(default=None, json_schema_extra={"type": "null"})
    seed: Optional[int] = Field(default=None, ge=0, le=MAX_SEED)  # extension, as in chat

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(
                    f"only tools of type 'function' are supported (got {kind!r}): this route runs no built-in tools"
                )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, value: Any) -> Any:
        return tool_choice_shape(
            value,
            lambda choice: choice.get("type") in ("function", "allowed_tools"),
            'must be "none", "auto", "required", {"type": "function", "name": ...} or '
            '{"type": "allowed_tools", "mode": ..., "tools": [...]} (this route runs function tools only)',
        )

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        if value is not None:
            if len(value) > MAX_METADATA_PAIRS:
                raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs")
            if any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
                raise ValueError("keys are at most 64 characters, values at most 512")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: Optional[bool]) -> Optional[bool]:
        if value:
            raise ValueError("background responses are not supported: make the call and wait for it")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("conversations are not supported: pass the items, or use 'previous_response_id'")
        return value

    @field_validator("prompt")
    @classmethod
    def _no_prompt(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("stored prompt templates are not supported: send 'instructions' and 'input'")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])


def parse_items(value: Union[str, list[Any], None]) -> list[Item]:
    """``input`` as items; a bad item is a 400 whose ``param`` names it (``input.2.content``)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [MessageItem(role="user", content=value)]
    items: list[Item] = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise bad_request(f"input.{i}: an input item must be an object.", param=f"input.{i}", code="invalid_value")
        kind = raw.get("type", "message" if "role" in raw else None)
        model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
        if model is None:
            hint = " (pass the item itself, or use 'previous_response_id')" if kind == "item_reference" else ""
            raise bad_request(
                f"input.{i}.type: input items of type {kind!r} are not supported{hint}; "
                f"this route takes {SUPPORTED_ITEMS} items.",
                param=f"input.{i}.type",
                code="invalid_value",
            )
        try:
            items.append(model.model_validate(raw))
        except ValidationError as exc:
            raise _prefixed(validation_error(exc), f"input.{i}") from None
    return items


def _prefixed(err: APIError, prefix: str) -> APIError:
    param = f"{prefix}.{err.param}" if err.param else prefix
    message = err.message.removeprefix(f"{err.param}: ") if err.param else err.message
    return bad_request(f"{param}: {message}", param=param, code=err.code)


def chat_messages(instructions: str | None, items: list[Item], first_new: int = 0) -> list[dict]:
    """The conversation as chat messages (see the module docstring).

    ``first_new``: how many leading items came from a previous response (errors name the
    request's own items by their index in ``input``).
    """
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions is not None else []
    assistant: dict | None = None
    calls: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, FunctionCallItem) or (isinstance(item, MessageItem) and item.role == "assistant"):
            if assistant is None:
                assistant = {"role": "assistant", "content": "", "tool_calls": []}
                messages.append(assistant)
            if isinstance(item, MessageItem):
                assistant["content"] += item.text()
            else:
                assistant["tool_calls"].append(
                    {
                        "id": item.call_id,
                        "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments},
                    }
                )
                calls.add(item.call_id)
            continue
        assistant = None
        if isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                where = f"input.{i - first_new}.call_id" if i >= first_new else "previous_response_id"
                raise bad_request(
                    f"{where}: no function_call with call_id '{item.call_id}' comes before this output.",
                    param=where,
                    code="invalid_value",
                )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            messages.append({"role": item.role, "content": item.text()})
    for message in messages:
        if message["role"] == "assistant":
            if not message["tool_calls"]:
                del message["tool_calls"]
            elif not message["content"]:
                message["content"] = None
    return messages


def to_chat_request(req: ResponsesRequest, items: list[Item], first_new: int = 0) -> ChatCompletionRequest:
    """The chat pipeline's request for ``req`` over the whole conversation ``items``."""
    messages = chat_messages(req.instructions, items, first_new)
    if not messages:
        raise bad_request(
            "input: there is nothing to respond to (give 'input' or 'instructions').",
            param="input",
            code="invalid_value",
        )
    tools = list(req.tools or [])
    choice: Any = req.tool_choice
    if isinstance(choice, FunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, AllowedToolsChoice):
        names = [t.name for t in tools]
        missing = [t.name for t in choice.tools if t.name not in names]
        if missing:
            raise bad_request(
                f"tool_choice: allowed tool '{missing[0]}' is not in 'tools' ({', '.join(names) or 'none'}).",
                param="tool_choice",
                code="invalid_value",
            )
        allowed = {t.name for t in choice.tools}
        tools, choice = [t for t in tools if t.name in allowed], choice.mode
    body = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "seed": req.seed,
        "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "tools": [t.chat() for t in tools] or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tool_calls": req.max_tool_calls,
    }
    if req.text is not None and req.text.format is not None:
        body["response_format"] = req.text.format.response_format()
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise for_responses(validation_error(exc)) from None


def for_responses(err: APIError) -> APIError:
    """A chat-pipeline error, named in the Responses request's terms."""
    if err.param is None:
        return err
    renamed = {
        "max_tokens": "max_output_tokens",
        "max_completion_tokens": "max_output_tokens",
        "response_format.json_schema.schema": "text.format.schema",
    }.get(err.param)
    parts = err.param.split(".")
    if renamed is None and parts[0] == "messages":
        renamed = "input"
    if renamed is None and parts[0] == "tools" and parts[2:3] == ["function"]:  # tools.<i>.function.parameters
        renamed = ".".join(parts[:2] + parts[3:])
    if renamed is None:
        return err
    message = err.message.replace(f"{err.param}: ", f"{renamed}: ", 1)
    return APIError(err.status, message, err.type, renamed, err.code)


# ----------------------------------------------------------------------------- response


def not_stored(response_id: str, param: str | None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found (responses are kept in memory, the most recent ones with "
        "store=true, and only for the route that made them: the same rollout attempt, or /v1).",
        "invalid_request_error",
        param,
        "previous_response_not_found" if param else "not_found",
    )


def output_items(output: list[dict]) -> list[Item]:
    """A response's output items as input items (what a client would pass back)."""
    return [ITEM_MODELS[item["type"]].model_validate(item) for item in output]


def response_object(
    response_id: str,
    req: ResponsesRequest,
    model: str,
    created_at: int,
    status: str,
    output: list[OutputItem],
    tokens: tuple[int, int] | None = None,
    completed_at: int | None = None,
) -> Response:
    """The ``response`` object for ``req``, its settings echoed; ``tokens``: (prompt, completion) once known."""
    return Response(
        id=response_id,
        created_at=created_at,
        status=status,
        completed_at=completed_at,
        incomplete_details=IncompleteDetails() if status == "incomplete" else None,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        max_tool_calls=req.max_tool_calls,
        metadata=dict(req.metadata or {}),
        model=model,
        output=output,
        parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        previous_response_id=req.previous_response_id,
        store=req.store is not False,
        temperature=1.0 if req.temperature is None else req.temperature,
        text=req.text.model_dump(by_alias=True, exclude_none=True)
        if req.text is not None and req.text.format is not None
        else {"format": {"type": "text"}},
        tool_choice=_dump(req.tool_choice) or "auto",
        tools=[tool.model_dump(exclude_none=True) for tool in req.tools or []],
        top_logprobs=req.top_logprobs,
        top_p=1.0 if req.top_p is None else req.top_p,
        truncation=req.truncation or "disabled",
        usage=None if tokens is None else ResponseUsage.of(*tokens),
    )


def _dump(value: Any) -> Any:
    return value.model_dump() if isinstance(value, BaseModel) else value
