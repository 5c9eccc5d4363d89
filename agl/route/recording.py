"""What the route keeps of its calls: spans in the store, and recent turns and responses in memory.

A ``Call`` is one generation request as the route ran it (its prompt ids, its choices' streams
and assembled outputs); the route answers from it (``agl.route.response_models.Answer``) and the
``Recorder`` stores it. Per choice, one span holds the exact prompt token ids, the sampled token
ids, their log-probs and the policy version that sampled them: what the trainer learns from. The
choices of one call share a ``trace_id``, each a separate sample. An unscoped ``/v1`` call is
recorded only with ``record_unscoped`` (``algo=serve``), into a rollout made for it
(``metadata={"served": "chat"}`` or ``"completion"``, no mode, no input: the span holds the
request) whose one attempt succeeds once its spans are stored.

In memory, bounded: each attempt's recent chat turns (``agl.route.rendering.History``), so a later call
can start its prompt with an earlier call's exact ids (``agl.route.rendering.render_prompt``; an attempt
not in memory, evicted or after a restart, gets its turns back from its spans), and the
Responses API's stored responses (``ResponseStore``), for ``previous_response_id``.
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agl.config import ServerConfig
from agl.errors import DiskFull
from agl.policy.engine import SequenceStream
from agl.policy.grammar import Grammar
from agl.route.output import OutputAssembler
from agl.route.rendering import History, Turn, decode
from agl.route.requests import ChatCompletionRequest, CompletionRequest, disk_full
from agl.route.tool_calls import ToolCallParser
from agl.types import Span

if TYPE_CHECKING:
    from agl.policy.load import Policy
    from agl.store import SqliteStore, StoreClient


@dataclasses.dataclass
class Choice:
    index: int
    stream: SequenceStream
    out: OutputAssembler
    finish_reason: str | None = None
    content: str | None = None
    tool_calls: list[dict] = dataclasses.field(default_factory=list)
    tools: ToolCallParser | None = None  # set when the reply is parsed for tool calls


@dataclasses.dataclass
class Call:
    """Everything about one generation request that the response and the spans need."""

    kind: str  # "chat" | "completion"
    req: ChatCompletionRequest | CompletionRequest
    prompt_ids: list[int]
    scope: tuple[str, str] | None  # (rollout_id, attempt_id) when recorded
    tools: list[dict] | None  # tools given to the template (and parsed back), if any
    reused_tokens: int
    seed: int | None  # the request's own, or derived for a rollout call (None: unscoped, unseeded)
    received_at: float  # perf_counter at arrival
    received_wall: float  # time.time() at arrival
    template: str | None = None  # chat: which template rendered the prompt (agl.route.tool_prompt.MODEL / BUILTIN)
    forced_ids: list[int] = dataclasses.field(default_factory=list)  # the prompt's last ids: a forced reply start
    forced_text: str = ""  # their text, where the parsed reply begins
    api_request: dict | None = None  # a Responses call: its id, previous_response_id, metadata (recorded)
    grammar: Grammar | None = None  # the grammar its reply follows (agl.route.structure), if any
    id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(12))
    choices: list[Choice] = dataclasses.field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.out.token_ids) for c in self.choices)


class Recorder:
    """Spans of finished calls into ``store``; the turns of each attempt for prefix reuse."""

    def __init__(
        self,
        store: SqliteStore | StoreClient | None,
        policy: Policy,
        record_unscoped: bool = False,
        frozen_names: Sequence[str] = (),
        history: History | None = None,
    ):
        if record_unscoped and store is None:
            raise ValueError("record_unscoped needs a store to record into")
        self.store = store
        self.policy = policy
        self.record_unscoped = record_unscoped  # /v1 calls too: each one a rollout of its own
        self.frozen_names = frozenset(frozen_names)  # the route's frozen helper models: spans marked not trainable
        self.history = history if history is not None else History()  # server.history_attempts / history_turns

    def is_frozen(self, call: Call) -> bool:
        """A call to a frozen helper model (an answerer, a judge): recorded, never trained on."""
        return call.req.model in self.frozen_names

    async def turns(self, scope: tuple[str, str]) -> list[Turn]:
        """Earlier turns of this attempt: from memory, else (e.g. after a restart) from its spans."""
        turns = self.history.get(scope)
        if turns is None:
            calls = [
                s
                for s in await self.store.query_spans(*scope)
                if s.name == "llm.chat"
                and s.prompt_token_ids
                and s.response_token_ids is not None
                and s.attributes.get("trainable", True)
            ]
            turns = [
                turn_of(self.policy.tokenizer, s) for s in calls[-self.history.turns_per_attempt :]
            ]  # the last chat turns
            self.history.load(scope, turns)
        return turns

    async def record(self, call: Call) -> None:
        """``_record``; a full disk is a 503 to the client (``disk_full``): a streamed answer records after its
        response began, outside the app's handler for it (agl/route/server.py)."""
        try:
            await self._record(call)
        except DiskFull as error:
            raise disk_full(error, "recorded") from None

    async def _record(self, call: Call) -> None:
        """One span per choice (same trace_id) for a rollout call; remember chat turns for prefix reuse.

        An unscoped call is recorded only with ``record_unscoped``, into a rollout made for it now
        (nothing is made for a call that failed or whose client left), and finished right after.
        """
        if call.scope is None and not self.record_unscoped:
            return
        if call.scope is None:
            served = await self.store.start_rollout(input=None, metadata={"served": call.kind})
            rollout_id, attempt_id = served.rollout_id, served.attempt.attempt_id
        else:
            rollout_id, attempt_id = call.scope
        request = _request(call)
        trace_id = secrets.token_hex(16)
        prompt_text = decode(self.policy.tokenizer, call.prompt_ids) if call.kind == "chat" else ""
        frozen = self.is_frozen(call)
        for choice in call.choices:
            stream, out = choice.stream, choice.out
            attributes = {
                "policy_version": None if frozen else stream.policy_version,
                "model": call.req.model if frozen else self.policy.name,
                "trainable": not frozen,
                "request": request,
                "choice_index": choice.index,
                "finish_reason": choice.finish_reason,
                "stop_string": out.stop_matched,
                "response_text": out.text,
                "tool_calls": choice.tool_calls or None,
                "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(out.token_ids)},
                "prompt_reused_tokens": call.reused_tokens,
                "timings": timings(call, stream),
            }
            if call.kind == "chat":
                attributes["chat_template"] = call.template
                attributes["forced_tokens"] = len(call.forced_ids)
            if call.grammar is not None:  # what the trainer replays to mask its log-probs as the sampler did
                attributes["constraint"] = {
                    "kind": call.grammar.kind,
                    "grammar": call.grammar.text,
                    "allowed": stream.allowed[: len(out.token_ids)],  # per token: how many it allowed (1: forced)
                }
            span = Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                trace_id=trace_id,
                name=f"llm.{call.kind}",
                start_time=call.received_wall,
                end_time=call.received_wall + ((stream.finished_at or time.perf_counter()) - call.received_at),
                attributes=attributes,
                prompt_token_ids=call.prompt_ids,
                response_token_ids=out.token_ids,
                response_logprobs=out.logprobs,
            )
            await self.store.add_span(span)
            if (
                call.kind == "chat" and call.scope is not None and not frozen
            ):  # a helper's turns would crowd out the policy's
                self.history.add(
                    call.scope, Turn(call.prompt_ids, out.token_ids, prompt_text, call.forced_text + out.text)
                )
        if call.scope is None:
            await self.store.update_attempt(rollout_id, attempt_id, status="succeeded")


def _request(call: Call) -> dict:
    """The span's ``request`` attribute: what was asked and the sampling actually used."""
    req = call.req
    sampling = {
        "max_tokens": call.choices[0].stream.params.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "n": req.n,
        "seed": call.seed,
        "seed_from": "request"
        if req.seed is not None
        else "derived"
        if call.seed is not None
        else "engine",  # engine: its shared generator (unscoped)
        "stop": req.stop_strings,
        "top_logprobs": req.n_top_logprobs,
        "ignore_eos": req.ignore_eos,
    }
    if call.kind != "chat":
        return {"prompt": req.prompt, "sampling": sampling}
    request = {
        "messages": [m.model_dump(exclude_none=True) for m in req.messages],
        "tools": call.tools,
        "tool_choice": req.tool_choice_json,
        "sampling": sampling,
    }
    if req.response_format is not None:
        request["response_format"] = req.response_format.model_dump(by_alias=True, exclude_none=True)
    if req.parallel_tool_calls is not None:
        request["parallel_tool_calls"] = req.parallel_tool_calls
    if call.api_request is not None:
        request["responses"] = call.api_request
    return request


def turn_of(tokenizer: Any, span: Span) -> Turn:
    """The turn a recorded chat span was: its reply text is its forced tokens' text + the returned text."""
    forced = span.attributes.get("forced_tokens") or 0
    reply = (decode(tokenizer, span.prompt_token_ids[-forced:]) if forced else "") + (
        span.attributes.get("response_text") or ""
    )
    return Turn(
        list(span.prompt_token_ids), list(span.response_token_ids), decode(tokenizer, span.prompt_token_ids), reply
    )


def timings(call: Call, stream: SequenceStream) -> dict:
    """Seconds: render (arrival -> submit), queue (submit -> prefill starts), prefill (-> first token), total."""
    end = stream.finished_at or time.perf_counter()
    first = stream.first_token_at
    admitted = getattr(stream, "admitted_at", None)
    return {
        "render_s": stream.submitted_at - call.received_at,
        "queue_s": None if admitted is None else admitted - stream.submitted_at,
        "prefill_s": None if admitted is None or first is None else first - admitted,
        "first_token_s": None if first is None else first - stream.submitted_at,
        "total_s": end - call.received_at,
    }


# ----------------------------------------------------------------------------- stored responses


@dataclasses.dataclass
class StoredResponse:
    """A Responses API response kept for ``previous_response_id`` and ``GET /v1/responses/{id}``."""

    scope: tuple[str, str] | None  # the route it was made on
    # the conversation's input items up to this response (agl.route.responses_api.Item; instructions not included)
    items: list
    output: list  # its output, as items a follow-up continues from
    body: dict  # the response object as returned


class ResponseStore:
    """Recent stored responses in memory, least recently used first out."""

    def __init__(self, max_responses: int = ServerConfig.stored_responses):
        self.max_responses = max_responses
        self._responses: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str, scope: tuple[str, str] | None) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is None or stored.scope != scope:
            return None
        self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, scope: tuple[str, str] | None) -> bool:
        if self.get(response_id, scope) is None:
            return False
        del self._responses[response_id]
        return True

    def __len__(self) -> int:
        return len(self._responses)
