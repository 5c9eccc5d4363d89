"""Spans to training samples: the only place a trajectory is assembled.

A rollout's LLM-call spans, in sequence order, each hold the exact prompt ids, sampled ids
and sampled logprobs. When call k+1's prompt starts with call k's prompt + response (the
route guarantees this for a conversation that extends the previous one), the calls merge
into one sequence: the tokens between them (tool results, user turns, template glue) join
the completion with mask 0, so only tokens the policy sampled carry loss. When the prefix
does not line up, the call starts a new sample. Nothing is ever re-tokenized. Calls to the
route's frozen helper models (span attribute ``trainable: false``: an answerer, a judge) are
left out: the policy did not sample them.

Worked example: call 1 prompt [P], response [a b]; call 2 prompt [P a b u], response [c].
Merged: prompt [P], completion [a b u c], mask [1 1 0 1], logprobs [la lb 0 lc].

A call sampled under a grammar (span attribute ``constraint``, agl.route.structure) recorded
masked log-probs; its response becomes a ``Constraint`` of the sample, which the update replays
to mask its own log-probs the same way (agl.policy.grammar.replay). A token the grammar forced
(it allowed that one token only) carried no choice: mask 0, as the glue between calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from agl.agents.api import final_reward
from agl.types import Span

LLM_SPAN_NAMES = ("llm.chat", "llm.completion")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """Completion tokens ``start .. start + length`` were sampled under ``grammar`` (llguidance's
    text), which began at ``start``."""

    start: int
    length: int
    grammar: str


@dataclasses.dataclass
class Sample:
    """One training sequence: ``prompt_ids + completion_ids``; loss only where mask is 1."""

    rollout_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]  # 1 = sampled by the policy
    logprobs: list[float]  # sampling-time logprob per completion token (0.0 where mask is 0)
    reward: float
    truncated: bool  # the last call stopped on length, not on a stop token
    temperature: float = 1.0
    policy_versions: tuple[int, ...] = ()
    group: str | None = None  # tasks sharing a group are compared with each other (GRPO)
    constraints: list[Constraint] = dataclasses.field(default_factory=list)  # grammar-sampled spans

    @property
    def num_sampled(self) -> int:
        return sum(self.mask)


def spans_to_samples(spans: Sequence[Span], reward: float | None = None, group: str | None = None) -> list[Sample]:
    """Merge a rollout's LLM calls into as few sequences as their token prefixes allow.

    ``reward`` defaults to the rollout's final reward span; it belongs to every sample.
    A rollout with no reward yields no samples: there is nothing to learn from it.
    """
    reward = final_reward(spans) if reward is None else reward
    calls = sorted((s for s in spans if is_policy_call(s)), key=lambda s: s.sequence_id or 0)
    if reward is None or not calls:
        return []
    samples: list[Sample] = []
    for call in calls:
        prompt = list(call.prompt_token_ids or [])
        response = list(call.response_token_ids or [])
        logprobs = list(call.response_logprobs or [0.0] * len(response))
        truncated = call.attributes.get("finish_reason") == "length"
        version = call.attributes.get("policy_version")
        temperature = sampling_temperature(call)
        constraint = call.attributes.get("constraint")
        mask = [1] * len(response)
        if constraint:  # a forced token (the only one its grammar allowed) is no choice: no loss
            mask = [0 if allowed == 1 else 1 for allowed in constraint["allowed"]]
        last = samples[-1] if samples else None
        if last is not None and last.temperature == temperature and _extends(prompt, last):
            glue = prompt[len(last.prompt_ids) + len(last.completion_ids) :]
            if constraint:
                start = len(last.completion_ids) + len(glue)
                last.constraints.append(Constraint(start, len(response), constraint["grammar"]))
            last.completion_ids += glue + response
            last.mask += [0] * len(glue) + mask
            last.logprobs += [0.0] * len(glue) + logprobs
            last.truncated = truncated
            last.policy_versions += (version,)
            continue
        samples.append(
            Sample(
                rollout_id=call.rollout_id,
                prompt_ids=prompt,
                completion_ids=response,
                mask=mask,
                logprobs=logprobs,
                reward=reward,
                truncated=truncated,
                temperature=temperature,
                policy_versions=(version,),
                group=group,
                constraints=[Constraint(0, len(response), constraint["grammar"])] if constraint else [],
            )
        )
    return [s for s in samples if s.num_sampled > 0]


def is_policy_call(span: Span) -> bool:
    """An LLM call the policy sampled, with its tokens recorded (not a frozen helper model's)."""
    return (
        span.name in LLM_SPAN_NAMES
        and span.response_token_ids is not None
        and span.attributes.get("trainable", True) is not False
    )


def sampling_temperature(call: Span) -> float:
    """The temperature the route divided logits by when it recorded this call's logprobs.

    Greedy calls (temperature 0) record the raw distribution, i.e. temperature 1.
    """
    sampling = (call.attributes.get("request") or {}).get("sampling") or {}
    temperature = sampling.get("temperature", 1.0)
    return float(temperature) if temperature and temperature > 0 else 1.0


def _extends(prompt: list[int], sample: Sample) -> bool:
    n_prev = len(sample.prompt_ids) + len(sample.completion_ids)
    return (
        len(prompt) >= n_prev
        and prompt[: len(sample.prompt_ids)] == sample.prompt_ids
        and prompt[len(sample.prompt_ids) : n_prev] == sample.completion_ids
    )
