"""Prompt rendering for the route, free of HTTP: the conversation through the model's chat template, with
exact prefix reuse.

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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from agl.config import ServerConfig
from agl.route.requests import Message
from agl.route.tool_calls import json_or_str

if TYPE_CHECKING:
    from agl.policy.load import Policy

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
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": json_or_str(call.function.arguments)},
                }
                for call in message.tool_calls
            ]
        out.append(item)
    return out


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

    def __init__(
        self, max_attempts: int = ServerConfig.history_attempts, turns_per_attempt: int = ServerConfig.history_turns
    ):
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


def render_prompt(policy: Policy, messages: list[dict], tools: list[dict] | None, turns: Sequence[Turn] = ()) -> Prompt:
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
    rest = text[len(turn.prompt_text) :]
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


# ----------------------------------------------------------------------------- tool calls
