"""The research workflow on the tiny model: eval, prompt search, SFT, report, and a custom task.

Everything goes through the real store, route and runners. The tiny model's text is noise, so
the agents score something noise varies in (vowels) or something the prompt decides.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg, typed_cfg
from runs import RUN, STEPS, all_metrics, query

import agl
from agl.config import to_typed
from agl.eval.stats import bootstrap_ci, mean_ci
from agl.jobs.eval import run_eval
from agl.jobs.prompt_search import run_prompt_search
from agl.policy.load import load_policy
from agl.report.tables import fmt
from agl.runtime import Runtime
from agl.train.sft import SFTTrainer, render_demonstration

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
TINY = ["model=tiny", "progress=false", "runner.n=8", "task.max_tokens=6"]
VOWELS = TINY + [
    "task=hello",
    "task.agent=e2e_agents:multi_turn_agent",
    "task.data=e2e_agents:load",
    "+task.resources.max_turns=2",
    "task.eval_size=6",
]


def lora_state(policy):
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


def metrics_lines(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


async def test_eval_of_a_saved_adapter_reproduces_the_training_eval(reference, tmp_path, device):
    """algo=eval with model.adapter=<the reference run> replies token for token as the run's final eval did."""
    lines = all_metrics(reference)
    baseline, final = lines[0], lines[-1]
    assert baseline["step"] == -1 and final["step"] == STEPS - 1 and "eval/reward" in final
    assert baseline["eval/n"] == final["eval/n"] == 4 and baseline["eval_all/n"] == final["eval_all/n"] == 6
    assert 0 < final["eval_all/said_a_p"] <= 1 and final["eval_all/said_a_base"] == baseline["eval_all/said_a"]

    task = [o for o in RUN if o.startswith(("model=", "task", "+task", "seed="))]
    # computed again (the eval cache would replay the training run's own rows: tests/test_eval_cache.py)
    eval_cfg = TINY + task + ["algo=eval", "eval_cache.reuse=off", f"device={device}"]
    trained = await run_eval(typed_cfg(eval_cfg + [f"model.adapter={reference}"]), tmp_path / "trained")
    assert trained["tasks"] == 4 and trained["adapter"] == str(reference / "adapter")
    assert trained["summary"]["reward"] == final["eval/reward"]  # exactly: greedy, same adapter
    assert trained["summary"]["turns"] == final["eval/turns"]
    base = await run_eval(typed_cfg(eval_cfg), tmp_path / "base")
    assert base["summary"]["reward"] == baseline["eval/reward"]  # and the base model = the baseline eval
    # token for token: the eval job's replies are the training run's final-eval replies
    at_end, at_start = await _replies(reference, eval_step=STEPS), await _replies(reference, eval_step=0)
    trained_replies = await _replies(tmp_path / "trained", eval="eval")
    assert trained_replies == {t: at_end[t] for t in trained_replies}  # its 4 tasks are the first 4 of the 6
    assert await _replies(tmp_path / "base", eval="eval") == {t: at_start[t] for t in trained_replies}
    assert at_end != at_start  # the adapter changed what the policy says, so the match means something

    written = json.loads((tmp_path / "trained" / "eval.json").read_text())
    assert written["summary"] == trained["summary"] and len(written["rollouts"]) == 4
    table = (tmp_path / "trained" / "eval.md").read_text()
    assert "| reward" in table and str(reference / "adapter") in table
    low, high = trained["intervals"]["said_a"]["lo"], trained["intervals"]["said_a"]["hi"]
    assert low <= trained["summary"]["said_a"] <= high and f"[{fmt(low)}, {fmt(high)}] of 4" in table
    # the final training eval carries the paired comparison with the baseline on the same tasks
    assert final["eval/said_a_base"] == baseline["eval/said_a"] and 0 < final["eval/said_a_p"] <= 1


async def _replies(run_dir, **tag):
    """{task_id: [response token ids of each LLM call]} for the rollouts whose metadata has ``tag``."""
    from agl.store import SqliteStore

    store = SqliteStore.open_readonly(run_dir / "store.sqlite")
    try:
        out = {}
        for rollout in await store.query_rollouts():
            if all(rollout.metadata.get(k) == v for k, v in tag.items()):
                spans = await store.query_spans(rollout.rollout_id, "latest")
                out[rollout.metadata["task_id"]] = [list(s.response_token_ids) for s in spans if s.name == "llm.chat"]
        return out
    finally:
        await store.close()


async def test_eval_pass_at_k_samples_k_tries_per_task(tmp_path):
    cfg = typed_cfg(
        VOWELS + ["algo=eval", "algo.size=3", "algo.k=2", "algo.temperature=1.0", "algo.pass_threshold=0.3"]
    )
    result = await run_eval(cfg, tmp_path)
    assert result["summary"]["n"] == 6 and "pass@2" in result["summary"]
    assert sorted(r["try"] for r in [*map(lambda r: r.metadata, await _rollouts(tmp_path))]) == [0, 0, 0, 1, 1, 1]


async def _rollouts(run_dir):
    from agl.store import SqliteStore

    store = SqliteStore.open_readonly(run_dir / "store.sqlite")
    try:
        return await store.query_rollouts()
    finally:
        await store.close()


def test_confidence_intervals():
    mean, lo, hi = mean_ci([0.0, 1.0] * 8)
    assert (
        mean == 0.5 and lo == pytest.approx(0.5 - 1.96 * (16 / 15 * 0.25 / 16) ** 0.5) and hi == pytest.approx(1 - lo)
    )
    assert mean_ci([0.3]) == (0.3, 0.3, 0.3) and mean_ci([1.0] * 5)[1:] == (1.0, 1.0)
    b_lo, b_hi = bootstrap_ci([0.0, 1.0] * 8, seed=1)
    assert 0.2 < b_lo < 0.5 < b_hi < 0.8 and bootstrap_ci([0.0, 1.0] * 8, seed=1) == (b_lo, b_hi)


async def test_prompt_search_ranks_the_marked_template_first(tmp_path):
    cfg = typed_cfg(
        TINY
        + [
            "task=hello",
            "task.agent=workflow_agents:marker_agent",
            "algo=prompt_search",
            "algo.size=8",
            "+task.prompts.marked='[BEST] {question}'",
            "algo.candidates=[plain,marked]",
        ]
    )
    result = await run_prompt_search(cfg, tmp_path)
    first, second = result["ranking"]
    assert result["best"] == "marked" and first["prompt"] == "marked" and second["prompt"] == "plain"
    assert first["n"] == second["n"] == 8  # hello's train split repeats its 8 questions: distinct tasks only
    assert first["mean"] >= 0.7 > 0.3 >= second["mean"]
    assert first["ci_bootstrap"][0] <= first["mean"] <= first["ci_bootstrap"][1]
    assert second["separated"] and first["summary"]["marked"] == 1.0
    text = (tmp_path / "prompt_search.md").read_text()
    assert "task.prompt=marked" in text and "95% CI (bootstrap)" in text
    saved = json.loads((tmp_path / "prompt_search.json").read_text())
    assert saved["best"] == "marked" and saved["templates"]["marked"] == "[BEST] {question}"
    # every rollout called the model through the route, under its own template's resources
    rollouts = await _rollouts(tmp_path)
    assert len(rollouts) == 16 and len({r.resources_id for r in rollouts}) == 2


def test_sft_mask_covers_assistant_content_and_end_of_turn(tiny_model_cfg):
    policy = load_policy(tiny_model_cfg, "cpu")
    messages = [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Lightning."}]
    ids, mask = render_demonstration(policy, messages)
    learned = [t for t, m in zip(ids, mask) if m]
    assert policy.tokenizer.decode(learned) == "I am Lightning.<|im_end|>"
    assert ids[: len(policy.render_chat(messages[:1]))] == policy.render_chat(
        messages[:1]
    )  # the prompt the route renders
    two_turns = messages + [{"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Lightning."}]
    ids, mask = render_demonstration(policy, two_turns)
    assert (
        policy.tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "I am Lightning.<|im_end|>Lightning.<|im_end|>"
    )


def test_sft_loss_through_the_fused_head_equals_the_full_logits_nll(tiny_model_cfg, monkeypatch, device):
    """The SFT loss and its gradients, computed only at assistant positions through the fused
    head, are the plain masked NLL of the model's full logits (the path for other output layers)."""
    import agl.train.forward
    from agl.train.sft import sft_loss_and_backward

    policy = load_policy(tiny_model_cfg, device)
    chats = [
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for q, a in [("Who are you?", "I am Lightning."), ("Name?", "Lightning, and a long answer to pad the batch.")]
    ]
    examples = [render_demonstration(policy, chat) for chat in chats]

    def loss_and_grads():
        policy.model.zero_grad(set_to_none=True)
        stats = sft_loss_and_backward(policy, examples, micro_batch_size=2)
        return stats, [p.grad.clone() for p in policy.trainable_parameters()]

    fused, fused_grads = loss_and_grads()
    monkeypatch.setattr(agl.train.forward, "fused_head", lambda policy: None)
    full, full_grads = loss_and_grads()
    assert fused["train_tokens"] == full["train_tokens"] == sum(sum(m) for _, m in examples)
    assert fused["loss"] == pytest.approx(full["loss"], rel=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(fused_grads, full_grads))
    assert any(g.abs().sum() > 0 for g in fused_grads)


async def test_sft_learns_checkpoints_and_its_adapter_is_picked_up_by_later_runs(tmp_path):
    cfg = compose_cfg(
        TINY
        + [
            "task=hello",
            "task.eval_size=2",
            "algo=sft",
            "algo.steps=4",
            "algo.batch_size=4",
            "algo.micro_batch_size=2",
            "algo.lr=1e-2",
        ]
    )
    async with Runtime.of(to_typed(cfg), tmp_path) as rt:
        trainer = SFTTrainer(rt, to_typed(cfg).algo)
        result = await trainer.train()
        trained = lora_state(rt.policy)
        checkpoints = [c.step for c in await rt.store.list_checkpoints()]
    assert result["steps"] == 4 and checkpoints == [0, 1, 2, 3]
    lines = metrics_lines(tmp_path)
    assert [line["step"] for line in lines] == [-1, 0, 1, 2, 3] and "eval/reward" in lines[-1]
    losses = [line["loss"] for line in lines[1:]]
    assert losses[-1] < losses[0], losses
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    # model.adapter=<run dir>: the next stage (GRPO, eval, SFT) starts from exactly these weights
    later = load_policy(compose_cfg(TINY + [f"model.adapter={tmp_path}"]).model, "cpu")
    reloaded = lora_state(later)
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[n], trained[n]) for n in trained)
    assert all(p.requires_grad for p in later.trainable_parameters()) and later.trainable_parameters()


def test_grpo_with_an_sft_warm_up_is_one_job_in_one_store(reference):
    """algo.warmup.steps=W (the reference run: W=1): SFT steps 0..W-1 on the demonstrations, an eval when
    they end, then GRPO, in one store."""
    lines = all_metrics(reference)
    assert [(line["step"], line.get("stage")) for line in lines] == [(-1, None), (0, "sft"), (1, "grpo"), (2, "grpo")]
    assert "sft_loss" in lines[1] and "reward_mean" not in lines[1]
    assert all("reward_mean" in line and "sft_loss" not in line for line in lines[2:])
    # evals: the baseline, after the warm-up (step 1: not a multiple of eval_every=2), at step 2, at the end
    assert [line["step"] for line in lines if "eval/reward" in line] == [-1, 0, 1, 2]
    assert [line["policy_version"] for line in lines[1:]] == [1, 2, 3]  # the warm-up step moved the LoRA too
    # only GRPO steps enqueue rollouts, tagged with their global step
    steps = query(reference, "SELECT DISTINCT json_extract(metadata, '$.step') FROM rollouts WHERE mode = 'train'")
    assert sorted(s for (s,) in steps) == [1, 2]
    states = query(reference, "SELECT json_extract(state, '$.stage') FROM checkpoints ORDER BY step")
    assert [s for (s,) in states] == ["sft", "grpo", "grpo"]


def test_report_reads_a_run_without_loading_a_model(reference, tmp_path):
    grpo_run = shutil.copytree(reference, tmp_path / "run")  # report= writes report.md and curves.png there
    code = (
        "import runpy, sys; sys.argv = ['harness.py', 'report=%s']; "
        "runpy.run_path('harness.py', run_name='__main__'); print('TORCH_LOADED', 'torch' in sys.modules)" % grpo_run
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for section in (
        "## run",
        "## best step",
        "## reward and accuracy by step",
        "## change against the base model",
        "## samples: the same eval tasks before and after training",
        "## slowest rollouts",
        "## failures by error",
    ):
        assert section in out, out
    assert out.count("before training (reward") == 5 and out.count("after 3 updates (reward") == 5
    assert "TORCH_LOADED False" in out
    assert "| algo      | grpo" in out and "3 of 3 (1 SFT warm-up + 2 GRPO) done" in out
    assert re.search(r"\| 1\s+\| [0-9.]+\s+\|", out)  # the step table has step 1's reward
    assert (grpo_run / "report.md").is_file() and (grpo_run / "curves.png").is_file()


def test_readme_custom_task_runs_through_task_custom(tmp_path, monkeypatch):
    """docs/agents.md's own-agent example, verbatim, trains through `task=custom` from the user's dir: the job
    harness.py runs, here in this process (agl.run), with the user's dir as the working directory and nothing
    else to import `my_agent` from."""
    page = (ROOT / "docs" / "agents.md").read_text()
    agent = (TESTS / "my_agent.py").read_text()
    data = (TESTS / "capitals.jsonl").read_text()
    assert agent.strip() in page and data.strip() in page, (
        "docs/agents.md and tests/my_agent.py, tests/capitals.jsonl differ"
    )
    shutil.copy(TESTS / "my_agent.py", tmp_path / "my_agent.py")
    shutil.copy(TESTS / "capitals.jsonl", tmp_path / "capitals.jsonl")
    monkeypatch.chdir(tmp_path)
    # as under `python harness.py`: the user's modules come from the working directory (agl puts it on the path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(TESTS))])
    monkeypatch.setitem(sys.modules, "my_agent", None)  # with the next line: after the test, as it was before
    monkeypatch.delitem(sys.modules, "my_agent")  # imported afresh, from the user's dir
    run_dir = tmp_path / "run"
    agl.run(
        "task=custom",
        "task.agent=my_agent:my_agent",
        "task.data=capitals.jsonl",
        "algo=grpo",
        "model=tiny",
        "progress=false",
        "algo.steps=1",
        "algo.batch_size=2",
        "algo.group_size=2",
        "task.max_tokens=4",
        "task.eval_size=2",
        run_dir=run_dir,
    )
    assert sys.modules["my_agent"].__file__ == str(tmp_path / "my_agent.py")
    lines = metrics_lines(run_dir)
    assert (
        [line["step"] for line in lines] == [-1, 0] and lines[-1]["rollouts"] == 4 and lines[-1]["rollouts_failed"] == 0
    )
    assert "eval/short" in lines[-1]  # the agent's emit_metric reached the eval table
    assert json.loads((run_dir / "status.json").read_text())["status"] == "succeeded"


@pytest.mark.parametrize("collect_every", [0, 4])
async def test_the_agents_cyclic_garbage_is_collected_every_few_rollouts(tmp_path, collect_every):
    """An openai client made per rollout sits in a reference cycle (with its SSL context, ~0.65 MiB)
    until a full collection, which Python runs rarely with a model loaded; the runtime runs one
    every ``runner.collect_every`` finished rollouts. Automatic collection is off here, so only
    the runtime's can free them (0: none, the control that the cycle is real; 4: one, once the
    4th and last rollout has finished). Replies are 4 tokens (server.default_max_tokens: the agent
    sends none): their length does not matter here."""
    import gc

    import e2e_agents

    cfg = compose_cfg(
        TINY
        + [
            "task=hello",
            "task.agent=e2e_agents:client_per_rollout_agent",
            "task.data=e2e_agents:load",
            "runner.n=2",
            f"runner.collect_every={collect_every}",
            "server.default_max_tokens=4",
        ]
    )
    e2e_agents.CLIENTS.clear()
    gc.collect()
    gc.disable()
    try:
        async with Runtime.of(to_typed(cfg), tmp_path) as rt:
            rows = rt.task.load("test")[:4]
            resources_id = await rt.resources_id(rt.task.resources_for(cfg.task.prompt))
            rollouts = await rt.run_rollouts(
                rows, [{"task_id": r["id"]} for r in rows], mode="val", resources_id=resources_id
            )
            alive = [ref for ref in e2e_agents.CLIENTS if ref() is not None]
            frozen = gc.get_freeze_count()  # the loaded model's objects: out of the collections (agl.memory)
    finally:
        gc.enable()
    assert [r.status for r in rollouts] == ["succeeded"] * 4 and len(e2e_agents.CLIENTS) == 4
    assert len(alive) == (4 if collect_every == 0 else 0)
    assert frozen > 10_000 and gc.get_freeze_count() == 0  # and back in them once the runtime has ended


async def test_an_async_agent_that_blocks_slows_only_itself(tmp_path, caplog):
    """A sync openai client inside an async agent used to freeze the route (same event loop):
    the agent's own request could not be answered and timed out. Now it runs, with a warning.
    Replies are 4 tokens (server.default_max_tokens: the agent sends none): what blocks is its sleep."""
    cfg = compose_cfg(
        TINY
        + [
            "task=hello",
            "task.agent=e2e_agents:blocking_async_agent",
            "task.data=e2e_agents:load",
            "runner.n=4",
            "server.default_max_tokens=4",
        ]
    )
    async with Runtime.of(to_typed(cfg), tmp_path) as rt:
        rows = rt.task.load("test")[:4]
        resources_id = await rt.resources_id(rt.task.resources_for(cfg.task.prompt))
        rollouts = await rt.run_rollouts(
            rows, [{"task_id": r["id"]} for r in rows], mode="val", resources_id=resources_id
        )
        assert [r.status for r in rollouts] == ["succeeded"] * 4
        for rollout in rollouts:
            assert [s.name for s in await rt.store.query_spans(rollout.rollout_id, "latest")] == ["llm.chat", "reward"]
    assert caplog.text.count("blocked its event loop") >= 4 and "blocking_async_agent" in caplog.text


@pytest.mark.parametrize("change", [{"gradient_checkpointing": True}, {"micro_batch_tokens": 40}])
def test_sft_checkpointing_and_token_budgets_keep_the_loss_and_gradients(tiny_model_cfg, change, device):
    """SFT with decoder layers replayed in backward, or cut into passes by a token budget: the same
    token-mean NLL and gradients as the plain micro-batches."""
    from agl.train.micro_batches import sft_micro_batches
    from agl.train.sft import sft_loss_and_backward

    policy = load_policy(tiny_model_cfg, device)
    chats = [
        [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        for q, a in [
            ("Who are you?", "I am Lightning."),
            ("Name?", "Lightning, and a long answer to pad the batch."),
            ("Why?", "Because."),
            ("How long is this answer going to be, then?", "Quite long: " + "more " * 12),
        ]
    ]
    examples = [render_demonstration(policy, chat) for chat in chats]
    if "micro_batch_tokens" in change:
        assert len(sft_micro_batches([len(ids) for ids, _ in examples], 4, change["micro_batch_tokens"])) > 1

    def loss_and_grads(**kwargs):
        policy.model.zero_grad(set_to_none=True)
        stats = sft_loss_and_backward(policy, examples, micro_batch_size=4, **kwargs)
        return stats, [p.grad.clone() for p in policy.trainable_parameters()]

    plain, plain_grads = loss_and_grads()  # sft_loss_and_backward's own defaults: no replay, no token cap
    changed, changed_grads = loss_and_grads(**change)
    assert changed["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    # fp32 sums in another order: within 1e-5 of each gradient's largest entry (the gap measured up to 3.6e-6 of it;
    # an absolute 1e-7 failed one run in several, before and after the merged LoRA layers alike)
    for a, b in zip(changed_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    assert any(g.abs().sum() > 0 for g in plain_grads)


def test_sft_micro_batches_sort_by_length_and_keep_to_both_caps():
    from agl.train.micro_batches import sft_micro_batches

    lengths = [300, 100, 250, 120, 900, 110]
    assert sft_micro_batches(lengths, 4) == [[1, 5, 3, 2], [0, 4]]
    assert sft_micro_batches(lengths, 4, 500) == [[1, 5, 3], [2], [0], [4]]  # 4 x 250 > 500; 900 alone, over the cap
    assert sorted(i for c in sft_micro_batches(lengths, 2, 600) for i in c) == list(range(6))
