"""The request side of the model route's OpenAI-compatible surface, and its errors.

Requests are validated here so that every bad input becomes a 400 with an OpenAI-style body
(``{"error": {"message", "type", "param", "code"}}``) instead of reaching the engine.

No field an agent sends changes the answer without a word. OpenAI's fields are either honoured,
refused with a 400 when they would change the answer and cannot be honoured (``logit_bias``,
non-zero ``frequency_penalty`` / ``presence_penalty``, the legacy ``functions`` /
``function_call``, audio output, ``web_search_options``; ``best_of`` > 1 and ``suffix`` on text
completions), or ignored because they change nothing here (listed on each request model, and in
docs/structured-outputs.md). Fields OpenAI does not define are ignored too: SDKs and frameworks
add their own.

Structure (docs/structured-outputs.md): ``response_format`` (``json_object``, ``json_schema``
strict or not) and, for tools, ``strict``, ``parallel_tool_calls`` and forced ``tool_choice``
become a grammar the sampled tokens follow (``agl.route.structure``).

Extensions beyond OpenAI (the same names vLLM uses):
  - ``return_token_ids``: the response carries ``prompt_token_ids`` (top level) and per-choice
    ``token_ids`` (the sampled ids, including a final eos token).
  - ``ignore_eos``: keep sampling past eos until ``max_tokens`` (benchmarks).

The response side (what the route answers) is ``agl.route.response_models``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_N = 64  # choices per request; the engine's batch is the real bound (checked by the server)
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class APIError(Exception):
    """An error answered to the client in OpenAI's format; raised anywhere in request handling."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, "not_found_error", None, code)


def conflict(message: str, code: str = "conflict") -> APIError:
    return APIError(409, message, "conflict_error", None, code)


def disk_full(error: Exception, done: str = "served") -> APIError:
    """A call the store could not read or record because its disk is full (``agl.errors.DiskFull``): a 503, not a
    logged server error; the job that owns the store is stopping on the same error. ``done``: what could not be
    done with the call (a streamed answer already delivered could not be "recorded")."""
    return APIError(503, f"This call could not be {done}: {error}", "server_error", code="disk_full")


def model_not_found(model: str, served: Sequence[str]) -> APIError:
    """OpenAI's answer to a model name it does not serve; ours also names the ones it does."""
    names = ", ".join(f"'{name}'" for name in served)
    message = (
        f"The model '{model}' does not exist on this route, which serves {names} (an agent gets the name as llm.model)."
    )
    return APIError(404, message, "invalid_request_error", "model", "model_not_found")


def request_too_large(size: str, limit: int) -> APIError:
    return APIError(
        413,
        f"The request body ({size}) is larger than this route accepts: {limit} bytes (server.max_request_bytes).",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def unauthorized(message: str = "Missing or invalid API key (expected 'Authorization: Bearer <key>').") -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400, naming the offending field like OpenAI's ``param``."""
    first = exc.errors(include_url=False)[0]
    loc = [str(part) for part in first.get("loc", ()) if not str(part).startswith(("function-", "tagged-union"))]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")  # pydantic's prefix to our own messages
    return bad_request(f"{param}: {message}" if param else message, param=param, code="invalid_value")


def parse_request(model: type[BaseModel], raw: bytes) -> Any:
    """Parse a JSON body into ``model``; any failure is a 400 in OpenAI's format."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    if SURROGATE_ESCAPE.search(raw):  # JSON can spell half a UTF-16 pair, which no tokenizer or store accepts
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(
                "The request contains an unpaired UTF-16 surrogate (invalid Unicode).", code="invalid_unicode"
            ) from None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


# ----------------------------------------------------------------------------- requests


class _Lenient(BaseModel):
    """Unknown fields are dropped: clients send fields we neither need nor reject."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


IMAGE_PARTS = ("image_url", "input_image")
OTHER_MEDIA_PARTS = {"input_file": "Files", "input_audio": "Audio"}


def text_parts_only(content: Any, text_kinds: tuple[str, ...] = ("text",)) -> Any:
    """Name what a text model cannot read, rather than failing the union of content shapes.
    ``text_kinds``: the part types that hold text (chat: ``text``; Responses: ``input_text``, ...)."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):  # no type, or junk: the part's own schema says what is wrong
                continue
            if kind in IMAGE_PARTS:
                raise ValueError(
                    f"Images are not supported: this model reads text only (content part of type '{kind}')."
                )
            if kind in OTHER_MEDIA_PARTS:
                raise ValueError(
                    f"{OTHER_MEDIA_PARTS[kind]} are not supported: "
                    f"this model reads text only (content part of type '{kind}')."
                )
            if kind not in text_kinds:
                raise ValueError(
                    f"Content parts of type '{kind}' are not supported: "
                    f"this model reads text only ({', '.join(text_kinds)})."
                )
    return content


def tool_choice_shape(value: Any, named: Callable[[dict], Any], message: str) -> Any:
    """``value`` if it is a mode ("none", "auto", "required") or a dict that ``named`` accepts; else
    ``message``: one clear error instead of one per shape of the union."""
    if value is None or value in ("none", "auto", "required") or (isinstance(value, dict) and named(value)):
        return value
    raise ValueError(message)


def text_only(*text_kinds: str) -> BeforeValidator:
    """A content field's check (``Annotated[..., text_only("text")]``): ``text_parts_only``."""
    return BeforeValidator(lambda content: text_parts_only(content, text_kinds))


class FunctionCall(_Lenient):
    name: str
    arguments: str = "{}"  # JSON text, as the model wrote it

    @field_validator("arguments", mode="before")
    @classmethod
    def _dict_to_json(cls, value: Any) -> Any:  # some clients send the parsed object
        return json.dumps(value) if isinstance(value, dict) else value


class ToolCall(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


# What the checks below accept, in JSON schema terms: the route's OpenAPI document (agl.route.openapi) then
# describes only requests it takes (a token id past the vocabulary, which depends on the model, excepted).
NOT_NULL = {"not": {"type": "null"}}
NO_TOOL_CALLS = {"type": ["array", "null"], "maxItems": 0}
TEXT = {"type": "string", "minLength": 1}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
STOP_SCHEMA = [TEXT, {"type": "array", "items": TEXT, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]
PROMPT_SCHEMA = [
    TEXT,
    TOKEN_IDS,
    {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 1},
]


def _what_each_role_needs(schema: dict) -> None:
    """The JSON schema's word for ``Message``'s checks (``_content_required``, ``_tool_call_id_required``),
    so the route's OpenAPI document (``agl.route.openapi``) describes only messages it accepts."""
    schema["anyOf"] = [
        {
            "properties": {
                "role": {"enum": ["system", "developer", "user"]},
                "content": NOT_NULL,
                "tool_calls": NO_TOOL_CALLS,
            },
            "required": ["content"],
        },
        {
            "properties": {
                "role": {"const": "tool"},
                "content": NOT_NULL,
                "tool_call_id": {"type": "string"},
                "tool_calls": NO_TOOL_CALLS,
            },
            "required": ["content", "tool_call_id"],
        },
        {"properties": {"role": {"const": "assistant"}, "content": NOT_NULL}, "required": ["content"]},
        {
            "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
            "required": ["tool_calls"],
        },
    ]
    schema["properties"]["tool_calls"]["description"] = "assistant messages only"


class Message(_Lenient):
    """One chat message. ``content`` may be a string or a list of text parts.

    ``developer`` is OpenAI's newer name for ``system`` (newer SDKs send it); templates get ``system``.
    """

    model_config = ConfigDict(json_schema_extra=_what_each_role_needs)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Union[str, list[TextPart], None], text_only("text")] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = Field(default=None, validate_default=True)

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_required(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        if value is None and info.data.get("role") == "tool":  # so the param named is messages.<i>.tool_call_id
            raise ValueError("a 'tool' message needs 'tool_call_id' (the id of the call it answers)")
        return value

    @model_validator(mode="after")
    def _content_required(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined without separator, as OpenAI does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # true: the call's arguments follow ``parameters`` (agl.route.structure)


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Lenient):
    name: str = Field(min_length=1)


class NamedToolChoice(_Lenient):
    """``{"type": "function", "function": {"name": ...}}``: the reply must call this function."""

    type: Literal["function"]
    function: ToolChoiceFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class JSONSchemaFormat(_Lenient):
    """``response_format.json_schema``: the reply is JSON valid against ``schema`` (strict or not: the
    route enforces both, see docs/structured-outputs.md)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Lenient):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("'json_schema' is required when type is \"json_schema\"")
        return self

    @property
    def schema(self) -> dict | None:
        """The JSON schema the reply must follow (None: plain text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            return self.json_schema.json_schema if self.json_schema.json_schema is not None else {}
        return None


GREEDY_BELOW = 1e-4


def _tiny_is_greedy(temperature: float | None) -> float | None:
    """A temperature under ``GREEDY_BELOW`` is greedy (0): the logits divided by it overflow
    float32 (7.8e-42 gave inf, then NaN, and an out-of-vocabulary token), and such a
    distribution is one-hot anyway. Recorded as 0, so the trainer reads the raw logits too."""
    return 0.0 if temperature is not None and temperature < GREEDY_BELOW else temperature


Temperature = Annotated[float, Field(ge=0.0, le=2.0), AfterValidator(_tiny_is_greedy)]


class _SamplingRequest(_Lenient):
    """Fields shared by chat and text completions."""

    prompt_param: ClassVar[str]  # the field that holds the prompt, named by errors about its length

    model: Optional[str] = None  # checked by the server (its policy's name or model_names); may be omitted
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = Field(default=None, json_schema_extra={"anyOf": STOP_SCHEMA})
    seed: Optional[int] = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # extensions (see module docstring)
    return_token_ids: bool = False
    ignore_eos: bool = False
    # OpenAI's, refused when they would change the answer (see ``_refuse_unsupported``)
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, Any]] = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, value: Optional[float]) -> Optional[float]:
        if value:
            raise ValueError(
                "only 0 is supported: a penalty would change the sampling distribution the trainer must reproduce"
            )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: Optional[dict]) -> Optional[dict]:
        if value:
            raise ValueError(
                "not supported: it would change the sampling distribution, which the trainer must reproduce "
                "(for structure, use response_format or tools)"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def completion_budget(self, prompt_tokens: int, context_length: int, default_max_tokens: int) -> int:
        """How many tokens to sample at most: ``token_limit`` if the prompt leaves room for it (a 400
        as OpenAI's if not), else the room left in the context, capped at ``default_max_tokens``."""
        limit = self.token_limit
        if limit is None:
            if context_length - prompt_tokens < 1:
                raise bad_request(
                    f"The prompt has {prompt_tokens} tokens, "
                    f"which leaves no room in the model's context length of {context_length} tokens.",
                    param=self.prompt_param,
                    code="context_length_exceeded",
                )
            return min(default_max_tokens, context_length - prompt_tokens)
        if prompt_tokens + limit > context_length:
            raise bad_request(
                f"This model's maximum context length is {context_length} tokens. However, you requested "
                f"{prompt_tokens + limit} tokens ({prompt_tokens} in the prompt, {limit} in the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return limit


def _chat_request_checks(schema: dict) -> None:
    """The JSON schema's word for ``ChatCompletionRequest``'s cross-field checks (as ``_what_each_role_needs``)."""
    schema["allOf"] = [
        {  # top_logprobs needs logprobs
            "anyOf": [
                {"properties": {"top_logprobs": {"enum": [None, 0]}}},
                {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
            ]
        },
        {  # tool_choice "required" or a named function needs tools (one of them by that name)
            "anyOf": [
                {"properties": {"tool_choice": {"enum": [None, "none", "auto"]}}},
                {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]},
            ]
        },
    ]


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``.

    Ignored, because they change nothing here: ``user``, ``metadata``, ``store``, ``service_tier``,
    ``prompt_cache_key``, ``safety_identifier``, ``prediction`` (a speed hint), ``reasoning_effort``
    and ``verbosity`` (this route runs no reasoning model), ``modalities: ["text"]``. Refused (400):
    ``logit_bias``, non-zero penalties, ``functions`` / ``function_call`` (use ``tools``), audio
    output, ``web_search_options``; ``stop`` or ``ignore_eos`` together with a structured reply.
    """

    model_config = ConfigDict(json_schema_extra=_chat_request_checks)
    prompt_param: ClassVar[str] = "messages"
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None  # false: at most one call per reply
    max_tool_calls: Optional[int] = Field(default=None, ge=1)  # the Responses API's, carried over
    response_format: Optional[ResponseFormat] = None
    # refused (see the docstring)
    functions: Optional[list[Any]] = None
    function_call: Any = None
    audio: Any = None
    modalities: Optional[list[str]] = None
    web_search_options: Any = None

    @field_validator("functions", "function_call")
    @classmethod
    def _no_functions(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "the legacy 'functions' / 'function_call' are not supported: use 'tools' and 'tool_choice'"
            )
        return value

    @field_validator("audio", "modalities")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, list) or any(m != "text" for m in value)):
            raise ValueError("audio output is not supported: this model writes text only")
        return value

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("not supported: this route runs no web search")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, value: Any) -> Any:
        def named(choice: dict) -> bool:
            function = choice.get("function")
            return (
                isinstance(function, dict)
                and choice.get("type") == "function"
                and isinstance(function.get("name"), str)
                and bool(function["name"])
            )

        return tool_choice_shape(
            value, named, 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value in (None, "none", "auto") or "tools" not in info.data:  # tools invalid: that error is reported
            return value
        names = [tool.function.name for tool in info.data["tools"] or []]
        if not names:
            raise ValueError("'tool_choice' \"required\" or a named function needs 'tools'")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"function '{value.function.name}' is not in 'tools' ({', '.join(names)})")
        return value

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_choice_json(self) -> str | dict | None:
        """``tool_choice`` as the client sent it (a named choice as a dict)."""
        return self.tool_choice.model_dump() if isinstance(self.tool_choice, BaseModel) else self.tool_choice

    @property
    def n_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs


class CompletionRequest(_SamplingRequest):
    """A text completion. One prompt per request: a string, token ids, or a one-element list of either.

    Ignored, because they change nothing here: ``user``, ``stream_options`` beyond ``include_usage``.
    Refused (400): ``echo``, ``best_of`` > 1, ``suffix``, ``logit_bias``, non-zero penalties.
    """

    prompt_param: ClassVar[str] = "prompt"
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(json_schema_extra={"anyOf": PROMPT_SCHEMA})
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = Field(default=False, json_schema_extra={"const": False})
    best_of: Optional[int] = Field(default=None, json_schema_extra={"maximum": 1})  # refused above 1 (use n)
    suffix: Optional[str] = Field(default=None, json_schema_extra={"maxLength": 0})  # refused (no insertion)

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value != 1:
            raise ValueError("only 1 is supported: sample 'n' choices and pick among them yourself")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Optional[str]) -> Optional[str]:
        if value:
            raise ValueError("not supported: this route completes prompts, it does not insert text")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request is supported (send one request per prompt)")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("'echo' is not supported")
        return value

    @property
    def n_top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None
