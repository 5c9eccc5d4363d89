"""Continuous batching changes when a sequence runs, never what it samples.

Requests arrive at scattered times with scattered lengths into an engine with few slots, so
rows retire and others take their slots mid-batch (agl.policy.kv_cache's slot moves, the merge's
left padding). Every sequence must get the tokens and log-probs it gets decoded alone. The
cache's buffers get no spare room here, so they grow and compact as often as they can.
"""

import asyncio
import threading

import pytest
import torch
from helpers import eval_policy
from hypothesis import given, settings
from hypothesis import strategies as st

from agl.policy.engine import Engine, SamplingParams
from agl.policy.kv_cache import SlotLayer

TEXTS = ("Hi", "What is 2 + 2? Think step by step.", "Name a colour", "Write a long sentence about the sea and ships.")
LONGEST = 24


@pytest.fixture(scope="module")
def policy(tiny_model_cfg, device):
    return eval_policy(tiny_model_cfg, device)


@pytest.fixture(scope="module", autouse=True)
def no_spare_room():
    """Buffers exactly as large as needed: every admission and nearly every append regrows one."""
    saved = SlotLayer.slack
    SlotLayer.slack = 0
    yield
    SlotLayer.slack = saved


@pytest.fixture(scope="module")
def alone(policy):
    """Each prompt's greedy continuation of LONGEST tokens, decoded as a batch of one."""
    prompts = [policy.render_chat([{"role": "user", "content": text}]) for text in TEXTS]

    async def run():
        engine = Engine(policy, batch_invariant=True)
        await engine.start()
        try:
            seqs = [
                engine.submit(p, SamplingParams(max_tokens=LONGEST, temperature=0.0, ignore_eos=True))[0]
                for p in prompts
            ]
            await asyncio.gather(*(s.wait() for s in seqs))
        finally:
            await engine.stop()
        return prompts, [(s.token_ids, s.logprobs) for s in seqs]

    return asyncio.run(run())


def test_continuations_of_a_prompt_over_the_prefill_budget_are_admitted_together(policy):
    """The first prompt is admitted whatever its length; its other continuations share its prefill, so they
    cost nothing and join in the same step (each used to be prefilled again, in a step of its own)."""
    prompt = policy.render_chat([{"role": "user", "content": TEXTS[3]}])

    async def run():
        engine = Engine(policy, max_prefill_tokens=len(prompt) // 2, batch_wait_s=0)
        await engine.start()
        try:
            seqs = engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), n=4)
            await asyncio.gather(*(s.wait() for s in seqs))
        finally:
            await engine.stop()
        return engine.stats, seqs

    stats, seqs = asyncio.run(run())
    assert stats["prefill_tokens"] == len(prompt) and stats["prefill_shared_tokens"] == 3 * len(prompt)
    assert all(s.token_ids == seqs[0].token_ids for s in seqs)


# (prompt, max_tokens, delay in event-loop ticks, n: continuations sharing one prefill)
requests = st.lists(
    st.tuples(st.integers(0, len(TEXTS) - 1), st.integers(1, LONGEST), st.integers(0, 6), st.integers(1, 2)),
    min_size=2,
    max_size=9,
)


@pytest.mark.parametrize("decode", ["fast", "model"])
@given(schedule=requests, slots=st.integers(1, 3))
@settings(max_examples=10, deadline=None, derandomize=True)
def test_scattered_requests_get_what_they_get_alone(policy, alone, decode, schedule, slots):
    prompts, expected = alone

    async def run():
        engine = Engine(policy, max_batch_size=slots, batch_wait_s=0, decode=decode)
        await engine.start()

        async def request(prompt, max_tokens, delay, n):
            for _ in range(delay):  # let the engine take a few steps first
                await asyncio.sleep(0.002)
            seqs = engine.submit(
                prompts[prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), n=n
            )
            return await asyncio.gather(*(s.wait() for s in seqs))

        try:
            return await asyncio.gather(*(request(*r) for r in schedule))
        finally:
            await engine.stop()

    for (prompt, max_tokens, _, _), seqs in zip(schedule, asyncio.run(run())):
        tokens, logprobs = expected[prompt]
        for seq in seqs:
            assert seq.token_ids == tokens[:max_tokens]
            torch.testing.assert_close(
                torch.tensor(seq.logprobs), torch.tensor(logprobs[:max_tokens]), atol=1e-4, rtol=0
            )


def test_steps_run_on_the_one_compute_thread(policy, monkeypatch):
    """Every engine's steps run on agl.policy.compute_thread's thread (one OpenMP pool for the process, so its
    workers spin between a step's parallel regions), and so does the cache's row compaction when rows retire at
    different lengths: the event loop only decides which rows go."""
    from agl.policy import compute_thread
    from agl.policy import engine as engine_module

    steps, compactions = [], []
    step, keep_rows = Engine._step, engine_module.keep_rows

    def recording_step(self, admit):
        steps.append(threading.get_ident())
        return step(self, admit)

    def recording_keep_rows(*args):
        compactions.append(threading.get_ident())
        return keep_rows(*args)

    monkeypatch.setattr(Engine, "_step", recording_step)
    monkeypatch.setattr(engine_module, "keep_rows", recording_keep_rows)

    async def run():
        engines = [Engine(policy), Engine(policy, batch_invariant=True)]
        for engine in engines:
            await engine.start()
        prompt = policy.render_chat([{"role": "user", "content": TEXTS[0]}])
        seqs = [
            seq
            for engine in engines
            for n in (2, 3, 5)  # three rows that end on three different steps
            for seq in engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        ]
        await asyncio.gather(*(s.wait() for s in seqs))
        for engine in engines:
            await engine.stop()
        assert [len(s.token_ids) for s in seqs] == [2, 3, 5] * 2
        return await compute_thread.run(threading.get_ident), await compute_thread.run(torch.get_num_threads)

    compute, torch_threads = asyncio.run(run())
    assert compactions, "no row was compacted: the test no longer covers retiring rows"
    assert set(steps) == set(compactions) == {compute} and compute != threading.get_ident()
    # call() blocks on it from a script's thread, and runs at once when already on it (no wait on itself)
    assert compute_thread.call(threading.get_ident) == compute
    assert compute_thread.call(compute_thread.call, threading.get_ident) == compute
    compute_thread.set_threads(1)
    try:
        assert asyncio.run(compute_thread.run(torch.get_num_threads)) == 1
    finally:
        compute_thread.set_threads(torch_threads)
