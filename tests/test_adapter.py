"""Spans to samples: masks, merge / no-merge, reward assignment (property tests)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from agl.train.samples import final_reward, spans_to_samples
from agl.types import Span

tokens = st.lists(st.integers(0, 1000), min_size=1, max_size=12)


def llm_span(seq, prompt, response, finish="stop", temperature=1.0, version=0):
    return Span(
        rollout_id="r",
        attempt_id="a",
        sequence_id=seq,
        name="llm.chat",
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=[-0.5 - i for i in range(len(response))],
        attributes={
            "finish_reason": finish,
            "policy_version": version,
            "request": {"sampling": {"temperature": temperature}},
        },
    )


def reward_span(seq, value):
    return Span(rollout_id="r", attempt_id="a", sequence_id=seq, name="reward", attributes={"reward": value})


@given(st.lists(st.tuples(tokens, tokens), min_size=1, max_size=5), st.floats(-5, 5))
@settings(max_examples=80, deadline=None)
def test_a_conversation_that_extends_itself_merges_into_one_sample(turns, reward):
    """Each call's prompt = previous prompt + previous response + new user tokens."""
    spans, prompt = [], [7, 7]
    sampled = []
    for i, (user, response) in enumerate(turns):
        prompt = prompt + user
        spans.append(llm_span(i, prompt, response))
        sampled.append((len(prompt), response))
        prompt = prompt + response
    spans.append(reward_span(len(turns), reward))
    [sample] = spans_to_samples(spans)
    full = sample.prompt_ids + sample.completion_ids
    assert full == prompt  # nothing re-tokenized, nothing lost
    assert sample.prompt_ids == [7, 7] + turns[0][0]
    # the mask covers exactly the sampled tokens, and logprobs line up with them
    for start, response in sampled:
        offset = start - len(sample.prompt_ids)
        assert sample.mask[offset : offset + len(response)] == [1] * len(response)
        assert sample.logprobs[offset : offset + len(response)] == [-0.5 - i for i in range(len(response))]
    assert sum(sample.mask) == sum(len(r) for _, r in turns)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.mask) if m == 0)
    assert sample.reward == reward


@given(st.lists(st.tuples(tokens, tokens), min_size=2, max_size=4))
@settings(max_examples=60, deadline=None)
def test_calls_whose_prefix_does_not_line_up_stay_separate(calls):
    # prompts that start with a marker token unique to the call never extend one another
    spans = [llm_span(i, [2000 + i] + p, r) for i, (p, r) in enumerate(calls)]
    samples = spans_to_samples(spans + [reward_span(99, 1.0)])
    assert len(samples) == len(calls)
    for sample, (p, r) in zip(samples, calls):
        assert sample.completion_ids == r and sample.mask == [1] * len(r)
        assert sample.reward == 1.0


def test_a_rewritten_history_breaks_the_merge():
    # call 2 re-rendered call 1's reply with different tokens: no merge, two samples
    spans = [llm_span(0, [1, 2], [3, 4]), llm_span(1, [1, 2, 3, 9, 5], [6]), reward_span(2, 0.5)]
    a, b = spans_to_samples(spans)
    assert (a.prompt_ids, a.completion_ids) == ([1, 2], [3, 4])
    assert (b.prompt_ids, b.completion_ids) == ([1, 2, 3, 9, 5], [6])


def test_reward_is_the_last_reward_span_and_no_reward_means_no_samples():
    spans = [llm_span(0, [1], [2]), reward_span(1, 0.2), reward_span(5, 0.9), reward_span(3, 0.1)]
    assert final_reward(spans) == 0.9
    assert spans_to_samples(spans)[0].reward == 0.9
    assert spans_to_samples([llm_span(0, [1], [2])]) == []
    assert spans_to_samples([llm_span(0, [1], [2])], reward=1.0)[0].reward == 1.0


def test_spans_are_ordered_by_sequence_id_and_truncation_is_the_last_calls():
    spans = [llm_span(1, [1, 2, 3, 4], [5], finish="length"), llm_span(0, [1, 2], [3, 4]), reward_span(2, 1.0)]
    [sample] = spans_to_samples(spans)
    assert sample.completion_ids == [3, 4, 5] and sample.mask == [1, 1, 1]
    assert sample.truncated


def test_temperature_comes_from_the_recorded_request_and_greedy_means_one():
    assert spans_to_samples([llm_span(0, [1], [2], temperature=0.7)], reward=1.0)[0].temperature == 0.7
    assert spans_to_samples([llm_span(0, [1], [2], temperature=0.0)], reward=1.0)[0].temperature == 1.0
    # a change of temperature between turns starts a new sample: their logprobs differ in kind
    spans = [llm_span(0, [1], [2], temperature=0.7), llm_span(1, [1, 2, 3], [4], temperature=1.0)]
    assert len(spans_to_samples(spans, reward=1.0)) == 2
