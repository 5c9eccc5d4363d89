"""Runners against the real store: outcomes, retries, timeouts, hooks, rewards. No model needed."""

import asyncio
import time

import pytest

import agl
from agl.agents.runner import Hook, Runner, RunnerPool
from agl.store import SqliteStore
from agl.types import RolloutConfig


@pytest.fixture
async def store(tmp_path):
    s = SqliteStore(tmp_path / "store.sqlite", watchdog_interval=0.05)
    async with s:
        yield s


def make_runner(store, agent, **kwargs):
    return Runner(
        store=store,
        agent=agent,
        llm_endpoint=lambda r, a: f"http://127.0.0.1:1/rollout/{r}/attempt/{a}/v1",
        model_name="m",
        **kwargs,
    )


async def spans_named(store, rollout_id, name):
    return [s for s in await store.query_spans(rollout_id, "latest") if s.name == name]


async def test_sync_and_async_agents_get_task_llm_resources_and_report_rewards(store):
    seen = {}

    def sync_agent(task, llm, prompt_template, **resources):
        seen["sync"] = (task, llm.base_url, llm.model, prompt_template, resources)
        agl.emit_reward(0.25)
        agl.emit_metric("correct", 1)
        return 0.75

    async def async_agent(task, llm, **resources):
        agl.emit_reward(0.5)
        return None

    resources = await store.add_resources({"prompt_template": "Q: {question}", "bonus": 2})
    for agent, task in ((sync_agent, {"q": 1}), (async_agent, {"q": 2})):
        rollout = await store.enqueue_rollout(task)
        assert await make_runner(store, agent).run_one()
        done = await store.get_rollout_by_id(rollout.rollout_id)
        assert done.status == "succeeded" and done.resources_id == resources.resources_id
        rewards = [s.attributes["reward"] for s in await spans_named(store, rollout.rollout_id, "reward")]
        assert rewards == ([0.25, 0.75] if agent is sync_agent else [0.5])
    task, url, model, template, extra = seen["sync"]
    assert (
        task == {"q": 1}
        and "/rollout/ro-" in url
        and model == "m"
        and template == "Q: {question}"
        and extra == {"bonus": 2}
    )


async def test_an_exception_fails_the_attempt_with_its_traceback_and_is_retried(store):
    calls = []

    def flaky(task, llm, **_):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("boom")
        return 1.0

    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    rollout = await store.enqueue_rollout({}, config=config)
    runner = make_runner(store, flaky)
    assert await runner.run_one()
    first = (await store.query_attempts(rollout.rollout_id))[0]
    assert first.status == "failed" and "ValueError: boom" in first.metadata["error"]
    assert "Traceback" in first.metadata["traceback"]
    assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "requeuing"
    assert await runner.run_one()
    assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "succeeded"
    # without retries the rollout fails for good
    rollout = await store.enqueue_rollout({})
    calls.clear()
    await runner.run_one()
    assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "failed"


async def test_a_stuck_agent_times_out_and_never_blocks_the_runner(store):
    async def stuck(task, llm, **_):
        await asyncio.sleep(60)

    def stuck_sync(task, llm, **_):
        time.sleep(1.0)  # a thread cannot be interrupted; the runner moves on without it
        return 1.0

    for agent in (stuck, stuck_sync):
        rollout = await store.enqueue_rollout(
            {}, config=RolloutConfig(timeout_seconds=0.2, max_attempts=2, retry_condition=["timeout"])
        )
        runner = make_runner(store, agent)
        start = time.perf_counter()
        await runner.run_one()
        assert time.perf_counter() - start < 0.9
        assert (await store.query_attempts(rollout.rollout_id))[0].status == "timeout"
        assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "requeuing"
        await runner.run_one()
        assert (await store.get_rollout_by_id(rollout.rollout_id)).status == "failed"


async def test_hooks_run_in_order_can_set_the_reward_and_a_raising_hook_fails_the_attempt(store):
    order = []

    class Recorder(Hook):
        def on_rollout_start(self, *, agent, runner, rollout):
            order.append("rollout_start")

        async def on_trace_start(self, *, agent, runner, rollout):
            order.append("trace_start")

        def on_trace_end(self, *, agent, runner, rollout):
            order.append("trace_end")

        def on_rollout_end(self, *, agent, runner, rollout, spans):
            order.append("rollout_end")
            return 10 * sum(s.attributes["reward"] for s in spans if s.name == "reward")

    def agent(task, llm, **_):
        order.append("agent")
        agl.emit_reward(0.1)

    rollout = await store.enqueue_rollout({})
    await make_runner(store, agent, hooks=[Recorder()]).run_one()
    assert order == ["rollout_start", "trace_start", "agent", "trace_end", "rollout_end"]
    rewards = await spans_named(store, rollout.rollout_id, "reward")
    assert rewards[-1].attributes == {"reward": pytest.approx(1.0), "final": True}

    class Broken(Hook):
        def on_trace_start(self, *, agent, runner, rollout):
            raise RuntimeError("hook broke")

    rollout = await store.enqueue_rollout({})
    runner = make_runner(store, agent, hooks=[Broken()])
    await runner.run_one()
    attempt = (await store.query_attempts(rollout.rollout_id))[0]
    assert attempt.status == "failed" and "hook broke" in attempt.metadata["error"]
    assert await runner.run_one() is False  # the runner is alive and the queue is empty


async def test_a_pool_runs_sync_agents_concurrently(store):
    def slow(task, llm, **_):
        time.sleep(0.3)
        return 1.0

    rollouts = [await store.enqueue_rollout({"i": i}) for i in range(8)]
    start = time.perf_counter()
    async with RunnerPool(8, store=store, agent=slow, llm_endpoint=lambda r, a: "", model_name="m"):
        done = await store.wait_for_rollouts([r.rollout_id for r in rollouts], timeout=10)
    assert len(done) == 8 and all(r.status == "succeeded" for r in done)
    assert time.perf_counter() - start < 2.0  # 8 x 0.3 s serially would be 2.4 s


def test_emit_reward_outside_a_rollout_says_so():
    with pytest.raises(RuntimeError, match="outside a rollout"):
        agl.emit_reward(1.0)
