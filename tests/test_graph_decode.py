"""agl.policy.graph_decode's static-shape step samples what agl.policy.decode's step samples: rows padded to a
bucket, the cache's columns to another, keys and values written in place. On a CPU it runs eagerly (the
graph-ready step); on the CUDA lane each shape is captured as a CUDA graph and replayed, and sampling runs on
the device."""

import asyncio

import pytest
import torch
from test_decode import policy  # noqa: F401  the fixture: the tiny Llama and Qwen2
from test_merged import optimizer_step

from agl.policy.engine import Engine, SamplingParams, SequenceStream
from agl.policy.graph_decode import GraphDecodeStep, bucket


def run(policy, decode, requests, batch_invariant=False):
    """Every (prompt, params, n) request through one engine; each sequence's (tokens, logprobs)."""

    async def go():
        engine = Engine(policy, decode=decode, batch_invariant=batch_invariant, max_batch_size=8)
        await engine.start()
        try:
            seqs = []
            for i, (prompt, params, n) in enumerate(requests):
                if i == len(requests) - 1:  # the last one joins a running batch
                    await asyncio.sleep(0.05)
                seqs += engine.submit(prompt, params, n=n)
            await asyncio.gather(*(s.wait() for s in seqs))
        finally:
            await engine.stop()
        return [(s.token_ids, s.logprobs) for s in seqs], engine

    return asyncio.run(go())


def requests_for(policy):
    prompts = [
        policy.render_chat([{"role": "user", "content": text}])
        for text in ("Hi", "What is 2 + 2? Think.", "Name a colour", "Count to ten, slowly, please.")
    ]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)  # retires early: rows move
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    return [(prompts[0], greedy, 1), (prompts[1], short, 1), (prompts[2], seeded, 2), (prompts[3], greedy, 1)]


def assert_same(got, expected):
    for (tokens, logprobs), (tokens_ref, logprobs_ref) in zip(got, expected, strict=True):
        assert tokens == tokens_ref
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(logprobs_ref), atol=1e-5, rtol=0)


def test_the_graph_step_samples_the_tokens_of_the_fast_step(policy):
    requests = requests_for(policy)
    (graph, engine), (fast, _) = run(policy, "graph", requests), run(policy, "fast", requests)
    assert isinstance(engine.decode_step, GraphDecodeStep)
    assert_same(graph, fast)
    optimizer_step(policy)  # a new merge: new weights, the graphs captured again
    (graph, _), (fast, _) = run(policy, "graph", requests), run(policy, "fast", requests)
    assert_same(graph, fast)


def test_the_graph_step_batch_invariant_gives_the_fast_steps_tokens(policy):
    requests = requests_for(policy)[:3]
    (graph, _), (fast, _) = run(policy, "graph", requests, True), run(policy, "fast", requests, True)
    assert_same(graph, fast)


def test_a_graph_step_keeps_its_cache_room_and_its_graphs(policy):
    """The cache is made with its rows and columns up front (no new buffer as rows join), and on a GPU a
    captured shape is replayed, not captured again."""
    requests = requests_for(policy)
    _, engine = run(policy, "graph", requests)
    step = engine.decode_step
    if policy.device.type == "cuda":
        assert step._graphs and all(g.graph is not None for g in step._graphs.values())
    else:
        assert not step._graphs  # eager on a CPU: nothing captured


def test_device_sampling_draws_a_seeded_row_the_same_in_any_batch(policy):
    """Sampling on the logits' device: a seeded row's token and log-prob do not depend on the rows beside it."""
    engine = Engine(policy, decode="graph")
    device = policy.device
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen).to(device)
    params = [
        SamplingParams(max_tokens=4, temperature=1.0, seed=11),
        SamplingParams(max_tokens=4, temperature=0.0),
        SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=2),
        SamplingParams(max_tokens=4, temperature=1.0, top_logprobs=2),
    ]

    def seqs():
        out = [SequenceStream([1], p, frozenset()) for p in params]
        for i, s in enumerate(out):
            if s.params.seed is not None:
                s.generator = torch.Generator().manual_seed(s.params.seed * 100 + i)
        return out

    alone = [engine._sample([s], logits[i : i + 1]) for i, s in enumerate(seqs())]
    together = engine._sample(seqs(), logits)
    for row in (0, 2):  # the seeded rows
        assert int(together[0][row]) == int(alone[row][0][0])
        assert float(together[1][row]) == pytest.approx(float(alone[row][1][0]), abs=1e-6)
    assert together[0].device.type == "cpu" and len(together[2][3]) == 2
    assert int(together[0][1]) == int(logits[1].argmax())


def test_buckets():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 17, 64)] == [1, 2, 4, 8, 32, 64]
    assert bucket(300, 4096, 64) == 512 and bucket(10, 4096, 64) == 64 and bucket(5000, 4096, 64) == 4096
