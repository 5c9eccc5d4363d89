"""A chat request's structure as the grammar its reply must follow (docs/structured-outputs.md).

``reply_grammar`` reads ``response_format``, the tools (``strict``), ``tool_choice``,
``parallel_tool_calls`` and ``max_tool_calls``, and gives the ``agl.policy.grammar.Grammar`` the
engine samples under, or None when the reply is free (no grammar, no cost):

  - ``response_format`` ``json_object`` / ``json_schema`` (strict or not: both are enforced): the
    reply is one JSON value valid against the schema, then eos;
  - ``tool_choice`` "required" or a named function: the route forces the call's opening
    (``agl.route.tool_prompt.forced_prefix``, part of the prompt) and the grammar covers the rest:
    the function's name (one of the tools'), its arguments, valid against its ``parameters``, the
    call's closing ``}\\n</tool_call>``, then, if parallel calls are allowed, more whole calls;
  - ``tool_choice`` "auto" with a ``strict`` tool, ``parallel_tool_calls: false``,
    ``max_tool_calls`` or a ``response_format``: free text (or the JSON reply) until the model opens
    a ``<tool_call>``; from there the call must be well formed, a strict tool's arguments valid
    against its schema (a non-strict tool's: any JSON object).

A schema the grammar cannot enforce (llguidance names the keyword: ``uniqueItems``, ``if``/``then``,
``not``, remote ``$ref`` ...) is a 400 naming it and the parameter it is in, never free text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from agl.policy.grammar import Grammar, check, lark_json
from agl.route.requests import ChatCompletionRequest, bad_request
from agl.route.tool_calls import CLOSE_TAG, OPEN_TAG

ANY_OBJECT = {"type": "object"}
# The call's envelope as Lark items, a space optional where JSON allows whitespace (as in the arguments,
# agl.policy.grammar.JSON_STYLE): '{"name": "add", "arguments": {..}}' and the compact form alike.
SPACE = '" "?'
CALL_START = f'"\\n{{\\"name\\":" {SPACE} "\\""'  # after '<tool_call>': up to the name's opening quote
ARGUMENTS = f'"\\"," {SPACE} "\\"arguments\\":" {SPACE}'  # from the name's closing quote to the arguments
CALL_END = f'{SPACE} "}}\\n{CLOSE_TAG}"'  # after the arguments: the call object's brace and the closing tag
NEXT_CALL = "\n"  # between two calls, as agl.route.tool_prompt renders them


def _literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def reply_grammar(
    req: ChatCompletionRequest, tools: Sequence[dict] | None, grammar_tokenizer: Callable[[], Any]
) -> Grammar | None:
    """The grammar of ``req``'s reply (None: free text). ``tools``: the tools given to the template
    (None when tools are off); ``grammar_tokenizer()``: llguidance's tokenizer, to check the grammar compiles,
    called only for a request with tools or a response format (making it costs a job 0.2-0.5 s).

    Raises the route's 400 for a schema it cannot enforce, and for ``stop`` or ``ignore_eos`` with a
    structured reply (a stop string would cut the JSON; the grammar ends on eos).
    """
    fmt = req.response_format.schema if req.response_format is not None else None
    if not tools and fmt is None:
        return None
    tokenizer = grammar_tokenizer()
    if tools:
        grammar = _tools_grammar(req, tools, fmt, tokenizer)
    else:
        _check_schema(fmt, "response_format.json_schema.schema", tokenizer)
        grammar = Grammar.json_schema(fmt, kind=req.response_format.type)
    if grammar is None:
        return None
    if req.stop_strings:
        raise bad_request(
            "'stop' cannot be combined with a structured reply (response_format, forced or strict tool calls, "
            "parallel_tool_calls false): a stop string would cut it. The structure ends the reply itself.",
            param="stop",
            code="invalid_value",
        )
    if req.ignore_eos:
        raise bad_request(
            "'ignore_eos' cannot be combined with a structured reply: its grammar ends on the eos token.",
            param="ignore_eos",
            code="invalid_value",
        )
    problem = check(grammar, tokenizer)
    if problem:  # each schema passed alone; together they should too, but say so if not
        raise bad_request(f"This request's structure cannot be enforced: {problem}", code="unsupported_schema")
    return grammar


def _check_schema(schema: Any, param: str, tokenizer: Any) -> None:
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be an object.", param=param, code="invalid_value")
    try:
        problem = check(Grammar.json_schema(schema), tokenizer)
    except ValueError as exc:  # llguidance's JSON options
        problem = str(exc)
    if problem:
        raise bad_request(
            f"{param}: this schema cannot be enforced: {problem}. Leave that keyword out, or describe it in words.",
            param=param,
            code="unsupported_schema",
        )


def _tools_grammar(
    req: ChatCompletionRequest, tools: Sequence[dict], fmt: dict | None, tokenizer: Any
) -> Grammar | None:
    choice = req.tool_choice_json
    forced = choice == "required" or isinstance(choice, dict)
    strict = [bool(t["function"].get("strict")) for t in tools]
    max_calls = 1 if req.parallel_tool_calls is False else req.max_tool_calls
    if not (forced or any(strict) or max_calls is not None or fmt is not None):
        return None
    schemas = {}
    for i, (tool, is_strict) in enumerate(zip(tools, strict)):
        function = tool["function"]
        enforced = forced or is_strict
        schema = (function.get("parameters") or ANY_OBJECT) if enforced else ANY_OBJECT
        if enforced:
            _check_schema(schema, f"tools.{i}.function.parameters", tokenizer)
        schemas[function["name"]] = schema
    if isinstance(choice, dict):
        schemas = {choice["function"]["name"]: schemas[choice["function"]["name"]]}
    # one call after its opening '<tool_call>' (and, on the call, its name and arguments)
    named = [f"{_literal(json.dumps(name)[1:-1])} {ARGUMENTS} {lark_json(schema)}" for name, schema in schemas.items()]
    rules = [
        "name_args: " + " | ".join(named),
        f"call: {CALL_START} name_args {CALL_END}",
    ]
    more = _more_calls(max_calls)
    if forced:  # the prompt ends with the forced opening: the grammar starts inside the first call
        if isinstance(choice, dict):
            first = f"{SPACE} {lark_json(next(iter(schemas.values())))}"
        else:
            first = "name_args"
        rules.insert(0, f"start: {first} {CALL_END} {more}".rstrip())
    else:
        calls = f"call {more}".rstrip()
        if fmt is not None:
            _check_schema(fmt, "response_format.json_schema.schema", tokenizer)
            rules.insert(0, f"start: {lark_json(fmt)} | {_literal(OPEN_TAG)} {calls}")
        else:
            rules.insert(0, f"start: TEXT | call_trigger {calls}")
            rules += [f"call_trigger[lazy]: TEXT {_literal(OPEN_TAG)}", r"TEXT: /(.|\n)*/"]
    return Grammar.lark("%llguidance {}\n" + "\n".join(rules) + "\n", kind="tool_calls")


def _more_calls(max_calls: int | None) -> str:
    """The calls after the first one: any number, or up to ``max_calls`` in all."""
    one = f"{_literal(NEXT_CALL + OPEN_TAG)} call"
    if max_calls is None:
        return f"({one})*"
    if max_calls <= 1:
        return ""
    return f"({one}){{0,{max_calls - 1}}}"
