"""Tools on a model whose chat template has none: the built-in Hermes/Qwen-style tool prompt.

SmolLM2-135M-Instruct, the default model, has a chat template without a tool section, yet
agents send ``tools``. For such a model the route rewrites the conversation the way Qwen2.5's
template renders tools (the Hermes format, which ``agl.route.tool_calls.parse_tool_calls`` reads back) and
renders the rewritten messages through the model's *own* template, so its special tokens and
turn markers stay its own:

  - the tools go into the system message: its text, a blank line, then ``TOOLS_PROMPT`` with
    one JSON schema per line inside ``<tools></tools>``; without a system message they make
    one of their own (the template's default system prompt, if any, is then not used);
  - an assistant message's tool calls become ``<tool_call>\\n{"name": .., "arguments": ..}\\n</tool_call>``
    blocks after its text, one per line;
  - tool results become ``<tool_response>\\n..\\n</tool_response>`` in a user message; consecutive
    results share one.

A span records which template rendered its prompt: attribute ``chat_template`` is ``"model"``
or ``"agl-hermes-tools"`` (``BUILTIN``).

Exact prefixes: an assistant message that is exactly what the model replied earlier in the
attempt (same text, same calls) is rendered as that reply's text, verbatim, not re-formatted.
A model that wrote ``{"name":"add","arguments":{"a":1}}`` (no spaces) thus finds its own
sampled text in the next prompt, and the turns merge into one training sequence.

``tool_choice`` "required" or a named function is enforced with ``forced_prefix``: the text the
reply must start with, appended to the prompt (so it carries no loss) before sampling.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agl.route.tool_calls import json_or_str, parse_tool_calls

MODEL = "model"  # the model's own chat template rendered the prompt (tools included, if any)
BUILTIN = "agl-hermes-tools"  # the model's template around this module's tool prompt

# Qwen2.5's tool instructions, word for word: models tuned on Hermes-style calls know them.
TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>"
)
CALL_BLOCK = "<tool_call>\n{call}\n</tool_call>"  # call: {"name": .., "arguments": ..} as JSON
RESPONSE_BLOCK = "<tool_response>\n{content}\n</tool_response>"
CALL_OPEN = '<tool_call>\n{"name": '  # how every rendered (and forced) call starts


def tools_section(tools: Sequence[dict]) -> str:
    """``TOOLS_PROMPT`` listing ``tools`` (OpenAI's ``{"type": "function", ...}``), one per line."""
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def call_block(name: str, arguments: Any) -> str:
    """One call as the prompt asks for it.

    >>> print(call_block("add", {"a": 1}))
    <tool_call>
    {"name": "add", "arguments": {"a": 1}}
    </tool_call>
    """
    return CALL_BLOCK.format(call=json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False))


def forced_prefix(tool_choice: Any) -> str:
    """The start a reply must have to honour ``tool_choice`` ("" when nothing is forced).

    A named function's prefix stops after ``"arguments":``, without the space: BPE tokenizers
    join that space to what follows (`` {"``), so a forced lone space would put the model off
    its own tokenization. ``"required"``'s ends in `` "``, which is how the name's quote is
    tokenized anyway.

    >>> forced_prefix("required")
    '<tool_call>\\n{"name": "'
    >>> forced_prefix({"type": "function", "function": {"name": "add"}})
    '<tool_call>\\n{"name": "add", "arguments":'
    >>> forced_prefix("auto")
    ''
    """
    if tool_choice == "required":
        return CALL_OPEN + '"'
    if isinstance(tool_choice, dict):
        return f'{CALL_OPEN}{json.dumps(tool_choice["function"]["name"], ensure_ascii=False)}, "arguments":'
    return ""


def needs_builtin(supports_tools: bool, messages: Sequence[dict], tools: Sequence[dict] | None) -> bool:
    """True when the model's template cannot render this conversation's tools, calls or results."""
    if supports_tools:
        return False
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def builtin_messages(messages: Sequence[dict], tools: Sequence[dict] | None, replies: Sequence[str] = ()) -> list[dict]:
    """``messages`` (as ``agl.route.rendering.template_messages`` gives them) with tools, calls and results
    written out as text, ready for a chat template that knows only system/user/assistant.

    ``replies``: the texts the model replied earlier in this attempt (for exact prefixes).

    >>> msgs = [{"role": "user", "content": "2+2?"},
    ...         {"role": "assistant", "content": "",
    ...          "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
    ...         {"role": "tool", "tool_call_id": "c", "content": "4"}]
    >>> [(m["role"], m["content"]) for m in builtin_messages(msgs, None)]  # doctest: +NORMALIZE_WHITESPACE
    [('user', '2+2?'), ('assistant', '<tool_call>\\n{"name": "add", "arguments": {"a": 2}}\\n</tool_call>'),
     ('user', '<tool_response>\\n4\\n</tool_response>')]
    """
    out: list[dict] = []
    rest = list(messages)
    if tools:
        section = tools_section(tools)
        if rest and rest[0]["role"] == "system":
            system = rest.pop(0)["content"]
            section = f"{system}\n\n{section}" if system else section
        out.append({"role": "system", "content": section})
    parsed = [(reply, parse_tool_calls(reply)) for reply in replies]
    previous_was_tool = False
    for message in rest:
        role = message["role"]
        if role == "tool":
            block = RESPONSE_BLOCK.format(content=message["content"])
            if previous_was_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(message, parsed)})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
        previous_was_tool = role == "tool"
    return out


def _assistant_text(message: dict, parsed_replies: Sequence[tuple[str, tuple[str | None, list[dict]]]]) -> str:
    """An earlier reply's exact text if the message is that reply, else the canonical rendering."""
    content = message.get("content") or ""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    for reply, (reply_content, reply_calls) in parsed_replies:
        if (reply_content or "") == content and [
            (c["function"]["name"], json_or_str(c["function"]["arguments"])) for c in reply_calls
        ] == calls:
            return reply
    return "\n".join(([content] if content else []) + [call_block(name, arguments) for name, arguments in calls])
