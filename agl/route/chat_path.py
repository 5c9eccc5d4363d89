"""The chat machinery: what ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` share.

``ChatPath`` takes a call from its HTTP request to its recorded spans; the endpoints only shape what goes back
(``agl.route.server`` for chat and text completions, ``agl.route.responses_endpoint`` for the Responses API). A
call goes through it in this order, each step refusing with an OpenAI-style ``APIError``:

    req = await chat.parse(request, ChatCompletionRequest)  # 413 body too large, 400 invalid, 404 unknown model
    scope, seed = await chat.check_scope(request, req.seed)  # 404 unknown rollout or attempt, 409 attempt finished
    call = await chat.render(req, scope, seed, received_at, received_wall)  # or chat.tokenize(...): 400
    chat.submit(call)  # 400 over the context or the engine's batch; its sequences are sampling from here on
    await chat.run_choice(choice, on_delta)  # each of call.choices; 500 if the engine failed, 503 if it stopped
    chat.settle_tools(choice)  # a reply parsed for tool calls: its content, calls and finish reason
    await chat.record(call)  # its spans (rollout calls, or every call with record_unscoped); 503 on a full disk

The caller owns the sequences once submitted: it cancels them when it is done or its client is gone, and
records only a call whose choices all ran to their end. ``served_name`` is the model name an answer carries,
``tokenizer`` the policy's. ``release`` lets go of the engines, the policy and the store when the route stops.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from agl.policy.engine import SamplingParams
from agl.policy.grammar import policy_grammar_tokenizer
from agl.route import structure, tool_prompt
from agl.route.output import Delta, OutputAssembler
from agl.route.recording import Call, Choice, Recorder
from agl.route.rendering import decode, render_prompt, template_messages
from agl.route.requests import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    conflict,
    model_not_found,
    not_found,
    parse_request,
    request_too_large,
)
from agl.route.streaming import scope_key
from agl.route.tool_calls import ToolCallParser
from agl.seeding import CallCounter, call_seed
from agl.store import charged_attempt_number, is_harness_ended

if TYPE_CHECKING:
    from agl.policy.engine import Engine
    from agl.policy.load import Policy
    from agl.store import SqliteStore, StoreClient

FINISHED_ATTEMPT_STATUSES = ("succeeded", "failed", "timeout")  # an "unresponsive" attempt may come back

RequestT = TypeVar("RequestT", bound=BaseModel)


class ChatPath:
    """Requests checked, made into ``Call``s, sampled on the engine and recorded; shared by the route's endpoints.

    Args:
        engine: samples the policy's calls.
        policy: renders prompts and names the served model (its ``tokenizer``, ``name``, ``context_length``).
        store: the run's store, where rollout routes are checked (None: only ``/v1`` is served).
        recorder: writes the spans of finished calls and keeps each attempt's turns.
        frozen: frozen helper models, name -> an engine sampling the base model (adapter off).
        model_names: more names a request's ``model`` may give for the policy.
        seed: the run seed; a rollout call without a seed of its own samples with one derived from it.
        default_max_tokens: a call's cap on sampled tokens when it gives none (``server.default_max_tokens``).
        max_request_bytes: the largest request body read (``server.max_request_bytes``).
    """

    def __init__(
        self,
        engine: Engine,
        policy: Policy,
        store: SqliteStore | StoreClient | None,
        recorder: Recorder,
        *,
        frozen: Mapping[str, Engine],
        model_names: Sequence[str],
        seed: int,
        default_max_tokens: int,
        max_request_bytes: int,
    ):
        self.engine = engine
        self.policy = policy
        self.store = store
        self.recorder = recorder
        self.frozen = dict(frozen)
        # what requests may name in `model`: the policy, its frozen helpers, and names registered for the policy
        self.model_names = tuple(dict.fromkeys([policy.name, *self.frozen, *model_names]))
        self.seed = seed
        self.default_max_tokens = default_max_tokens
        self.max_request_bytes = max_request_bytes
        self.call_numbers = CallCounter()  # per attempt, for the seeds derived from the run seed

    def release(self) -> None:
        """Let go of the engines, the policy, the store and the recorder: the route has stopped."""
        self.engine = self.policy = self.store = self.recorder = None
        self.frozen = {}

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def served_name(self, model: str | None) -> str:
        """The model name an answer carries: the frozen helper's that was asked for, else the policy's."""
        return model if model in self.frozen else self.policy.name

    # ------------------------------------------------------------------ checks

    async def _read_body(self, request: Request) -> bytes:
        """The request body, refused with a 413 once it passes ``max_request_bytes``: a declared
        Content-Length at once, a chunked body as soon as it has sent that much (never held whole)."""
        limit = self.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise request_too_large(f"{int(declared)} bytes", limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise request_too_large(f"over {limit} bytes", limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(self, request: Request, schema: type[RequestT]) -> RequestT:
        """The request's body, read under the size cap and validated into ``schema``, whose ``model`` this route
        serves (404 ``model_not_found`` otherwise; a request without one is served too)."""
        req = parse_request(schema, await self._read_body(request))
        if req.model is not None and req.model not in self.model_names:
            raise model_not_found(req.model, self.model_names)
        return req

    async def check_scope(self, request: Request, seed: int | None) -> tuple[tuple[str, str] | None, int | None]:
        """(rollout_id, attempt_id) of a rollout route, after 404 / 409 checks (None if unscoped),
        and the call's sampling seed: ``seed`` if given, else derived for a rollout call."""
        scope = scope_key(request)
        if scope is None:
            return None, seed
        rollout_id, attempt_id = scope
        if self.store is None:
            raise not_found("This server has no store, so rollout routes are unavailable; use /v1.")
        if await self.store.get_rollout_by_id(rollout_id) is None:
            raise not_found(f"Rollout '{rollout_id}' does not exist.", code="rollout_not_found")
        attempts = await self.store.query_attempts(rollout_id)
        attempt = next((a for a in attempts if a.attempt_id == attempt_id), None)
        if attempt is None:
            raise not_found(
                f"Attempt '{attempt_id}' of rollout '{rollout_id}' does not exist.", code="attempt_not_found"
            )
        if attempt.status in FINISHED_ATTEMPT_STATUSES:
            raise conflict(
                f"Attempt '{attempt_id}' of rollout '{rollout_id}' already finished ({attempt.status}).",
                code="attempt_finished",
            )
        if is_harness_ended(attempt):  # its runner's session ended (R7): a late call must not revive it (R3)
            raise conflict(
                f"Attempt '{attempt_id}' of rollout '{rollout_id}' was handed back to the queue when its runner's "
                "store session ended.",
                code="attempt_handed_back",
            )
        call_number = self.call_numbers.next(scope)
        if seed is None:
            seed = call_seed(self.seed, rollout_id, charged_attempt_number(attempts, attempt), call_number)
        return scope, seed

    # ------------------------------------------------------------------ calls

    async def render(
        self,
        req: ChatCompletionRequest,
        scope: tuple[str, str] | None,
        seed: int | None,
        received_at: float,
        received_wall: float,
    ) -> Call:
        """A chat request rendered to prompt ids (tool prompt, exact prefixes, forced reply start)."""
        use_tools = bool(req.tools) and req.tool_choice != "none"
        tools = [tool.model_dump(exclude_none=True) for tool in req.tools] if use_tools else None
        grammar = structure.reply_grammar(req, tools, lambda: policy_grammar_tokenizer(self.policy))
        if tools:  # `strict` is the route's business, not the prompt's
            tools = [{**t, "function": {k: v for k, v in t["function"].items() if k != "strict"}} for t in tools]
        messages = template_messages(req.messages)
        turns = await self.recorder.turns(scope) if scope and req.model not in self.frozen else ()
        template = tool_prompt.MODEL
        if tool_prompt.needs_builtin(self.policy.supports_tools, messages, tools):
            messages, template = (
                tool_prompt.builtin_messages(messages, tools, [t.reply_text for t in turns]),
                tool_prompt.BUILTIN,
            )
        try:
            prompt = render_prompt(self.policy, messages, tools if template == tool_prompt.MODEL else None, turns)
        except Exception as exc:  # jinja errors: roles that must alternate, missing fields, ...
            raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from None
        forced_text = tool_prompt.forced_prefix(req.tool_choice_json) if use_tools else ""
        forced = self.policy.tokenizer.encode(forced_text, add_special_tokens=False) if forced_text else []
        return Call(
            "chat",
            req,
            prompt.ids + forced,
            scope,
            tools,
            prompt.reused,
            seed,
            received_at,
            received_wall,
            template=template,
            forced_ids=forced,
            forced_text=decode(self.policy.tokenizer, forced),
            grammar=grammar,
        )

    def tokenize(
        self,
        req: CompletionRequest,
        scope: tuple[str, str] | None,
        seed: int | None,
        received_at: float,
        received_wall: float,
    ) -> Call:
        """A text completion's prompt as token ids: its text tokenized, or its ids checked against the vocabulary."""
        if isinstance(req.prompt, str):
            prompt_ids = self.policy.tokenizer(req.prompt)["input_ids"]
        else:
            vocab = len(self.policy.tokenizer)
            if max(req.prompt) >= vocab:
                raise bad_request(
                    f"Token id {max(req.prompt)} is out of range (vocabulary size {vocab}).", param="prompt"
                )
            prompt_ids = list(req.prompt)
        if not prompt_ids:
            raise bad_request("The prompt is empty.", param="prompt")
        return Call("completion", req, list(prompt_ids), scope, None, 0, seed, received_at, received_wall)

    def submit(self, call: Call) -> None:
        """Check the token budget, submit the call's sequences to the engine and set up its choices."""
        req = call.req
        max_tokens = req.completion_budget(len(call.prompt_ids), self.policy.context_length, self.default_max_tokens)
        engine = self.frozen.get(req.model, self.engine)
        if req.n > engine.max_batch_size:
            raise bad_request(f"n={req.n} exceeds the engine's batch size ({engine.max_batch_size}).", param="n")
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=call.seed,
            top_logprobs=req.n_top_logprobs,
            ignore_eos=req.ignore_eos,
            grammar=call.grammar,
        )
        streams = engine.submit(call.prompt_ids, params, n=req.n)
        tokenizer = self.policy.tokenizer
        call.choices = [
            Choice(
                i,
                s,
                OutputAssembler(tokenizer, req.stop_strings, s.stop_ids, top_logprobs=params.top_logprobs > 0),
                tools=ToolCallParser() if call.tools else None,
            )
            for i, s in enumerate(streams)
        ]

    @staticmethod
    async def run_choice(choice: Choice, on_delta: Callable[[Choice, Delta], Awaitable[None]] | None = None) -> None:
        """Consume one sequence's tokens until it ends or a stop string matches; ``on_delta`` gets the text
        released on the way (none of a matched stop string's)."""
        out = choice.out
        async for event in choice.stream:
            out.add(event.token_id, event.logprob, event.top_logprobs)
            if out.stop_matched:
                choice.stream.cancel()  # free the slot now; later tokens are never seen
                break
            if on_delta is not None:
                delta = out.release()
                if delta.text:
                    await on_delta(choice, delta)
        if not out.stop_matched:
            await choice.stream.wait()
            out.finish()
        if choice.stream.finish_reason == "error":
            raise APIError(
                500,
                f"The engine failed while generating this reply: {choice.stream.error}",
                "server_error",
                code="engine_error",
            )
        if choice.stream.finish_reason == "abort" and not out.stop_matched:
            raise APIError(
                503, "The engine stopped before this request finished.", "server_error", code="engine_stopped"
            )
        choice.finish_reason = "stop" if out.stop_matched else choice.stream.finish_reason
        choice.content = out.text

    @staticmethod
    def settle_tools(choice: Choice) -> list[dict]:
        """The reply's text is all fed to its tool parser: take the content and calls from it."""
        deltas = choice.tools.finish()
        choice.content, choice.tool_calls = choice.tools.content, choice.tools.calls
        if choice.tool_calls and not choice.tools.cut_in_call:  # a call cut short by max_tokens stays "length"
            choice.finish_reason = "tool_calls"
        return deltas

    async def record(self, call: Call) -> None:
        """The finished call's spans into the store (``Recorder.record``)."""
        await self.recorder.record(call)
