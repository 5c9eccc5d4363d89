"""The GRPO update on the tiny model: shared-prompt batching is exact; a step moves only the LoRA."""

import math
from pathlib import Path

import pytest
import torch

from agl.config import GRPOConfig, compose_checked
from agl.policy.load import load_policy
from agl.train.advantages import ESTIMATORS, advantages, drop_groups
from agl.train.forward import completion_logprobs
from agl.train.grpo import GRPOUpdate
from agl.train.loss import resolve_loss
from agl.train.micro_batches import plan_micro_batches
from agl.train.samples import Sample
from agl.train.token_batch import TokenBatch


@pytest.fixture(scope="module")
def policy(tiny_model_cfg, device):
    return load_policy(tiny_model_cfg, device)


def make_samples(prompt, completions, rewards, group="g"):
    return [
        Sample(
            rollout_id=f"{group}-{i}",
            prompt_ids=list(prompt),
            completion_ids=list(c),
            mask=[1] * len(c),
            logprobs=[-1.0] * len(c),
            reward=r,
            truncated=False,
            temperature=0.7,
            group=group,
        )
        for i, (c, r) in enumerate(zip(completions, rewards))
    ]


def lora_grads(policy):
    return {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.requires_grad and p.grad is not None}


def test_shared_prompt_forward_matches_the_padded_forward_in_value_and_gradient(policy):
    torch.manual_seed(0)
    prompt = torch.randint(10, 2000, (23,)).tolist()
    completions = [torch.randint(10, 2000, (n,)).tolist() for n in (5, 9, 1, 7)]
    samples = make_samples(prompt, completions, [1, 0, 0, 1])
    results = {}
    for share in (True, False):
        batch = TokenBatch.build(samples, pad_id=2, mask_truncated=False, share_prompt=share)
        assert (batch.shared_prompt is not None) == share
        policy.model.zero_grad()
        logp, _ = completion_logprobs(policy, batch)
        (logp * batch.mask_BT).sum().backward()
        results[share] = (logp.detach() * batch.mask_BT, lora_grads(policy))
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    assert results[True][1].keys() == results[False][1].keys() and results[True][1]
    for name, grad in results[True][1].items():
        torch.testing.assert_close(grad, results[False][1][name], atol=1e-5, rtol=1e-4)


def test_fused_logprob_head_matches_the_models_own_logits_in_value_entropy_and_gradient(policy):
    torch.manual_seed(1)
    prompt = torch.randint(10, 2000, (11,)).tolist()
    samples = make_samples(prompt, [torch.randint(10, 2000, (n,)).tolist() for n in (4, 6)], [1, 0])
    batch = TokenBatch.build(samples, pad_id=2, mask_truncated=False)
    results = {}
    for fused in (True, False):
        policy.model.zero_grad()
        logp, entropy = completion_logprobs(policy, batch, with_entropy=True, fused=fused)
        (logp * batch.mask_BT).sum().backward()
        results[fused] = (logp.detach() * batch.mask_BT, entropy * batch.mask_BT, lora_grads(policy))
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[True][1], results[False][1], atol=1e-4, rtol=1e-4)
    for name, grad in results[True][2].items():
        torch.testing.assert_close(grad, results[False][2][name], atol=1e-5, rtol=1e-4)


def test_micro_batches_keep_groups_together_and_pack_singletons():
    a = make_samples([1, 2], [[3], [4], [5]], [1, 0, 1], group="a")
    b = make_samples([7], [[8, 9]], [1], group="b")
    c = make_samples([6, 6, 6], [[1]], [0], group="c")
    plan = plan_micro_batches(a + b + c, size=2)
    assert plan == [[0, 1], [2], [4, 3]]  # singles longest first (prompt + completion)


def test_one_update_step_changes_only_the_lora_and_drops_zero_std_groups(policy):
    prompt = list(range(100, 120))
    good = make_samples(prompt, [[5, 6, 7], [8, 9], [10], [11, 12]], [1.0, 0.0, 0.0, 1.0], group="good")
    flat = make_samples(prompt[:5], [[5], [6]], [0.5, 0.5], group="flat")
    advs, flat_groups = advantages(good + flat, ESTIMATORS.get("grpo"))
    assert flat_groups == {"flat"} and advs[4:] == [0.0, 0.0]
    kept, advs = drop_groups(good + flat, advs, flat_groups)
    assert [s.group for s in kept] == ["good"] * 4
    assert advs[0] > 0 > advs[1]
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    update = GRPOUpdate(
        policy,
        GRPOConfig(lr=1e-2, loss={"type": "grpo", "epsilon_high": None}, micro_batch_size=3, old_logprobs="recompute"),
    )
    metrics = update.step(kept, advs)
    assert metrics["train_tokens"] == 8 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(torch.equal(p, frozen[n]) for n, p in policy.model.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(p, lora[n]) for n, p in policy.model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "opmd"])
def test_one_update_step_with_each_new_loss_type_changes_the_lora(policy, loss_type):
    prompt = list(range(200, 215))
    samples = make_samples(prompt, [[5, 6, 7], [8, 9], [10], [11, 12]], [1.0, 0.0, 0.0, 1.0], group=loss_type)
    kept, (advs, _) = samples, advantages(samples, ESTIMATORS.get("grpo"))
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    # recorded log-probs (-1.0 here, far from the tiny model's ~-10.8) make the step off-policy,
    # so the clip (cispo) and the gate (sapo) are away from r = 1; opmd ignores them.
    update = GRPOUpdate(policy, GRPOConfig(lr=1e-2, loss={"type": loss_type}, micro_batch_size=3))
    metrics = update.step(kept, advs)
    assert metrics["train_tokens"] == 8
    assert all(map(math.isfinite, (metrics["loss"], metrics["grad_norm"]))) and metrics["grad_norm"] > 0
    if loss_type == "cispo":  # every r = e^(logp + 1) < 0.8: all weights raised to 1 - epsilon, none dropped
        assert metrics["clip_ratio_low"] == 1.0
    assert any(not torch.equal(p, lora[n]) for n, p in policy.model.named_parameters() if p.requires_grad)


def test_the_yaml_composes_the_default_loss_and_advantage():
    yaml = compose_checked(str(Path(__file__).parent.parent / "conf"), ["algo=grpo"]).algo
    default = GRPOConfig()
    assert yaml.loss == default.loss == {"type": "dapo"} and yaml.advantage == default.advantage == "grpo"
    loss, params = resolve_loss(yaml.loss)
    assert (loss.name, loss.weighting, params.epsilon, params.high) == ("dapo", "token-mean", 0.2, 0.28)


def planner_samples(groups: list[tuple[int, list[int]]]) -> list[Sample]:
    """Per (prompt length, completion lengths): samples of one prompt (a group if 2+)."""
    samples = []
    for g, (prompt_len, lengths) in enumerate(groups):
        prompt = [1000 + g] * prompt_len  # one prompt per group, however long
        samples += make_samples(
            prompt, [[7 + j % 3] * n for j, n in enumerate(lengths)], [0.0] * len(lengths), group=f"g{g}"
        )
    return samples


def padded_tokens(samples: list[Sample], chunk: list[int]) -> int:
    """What a micro-batch's cap counts: a group's prompt + rows x longest completion, or rows x (longest prompt +
    completion)."""
    rows = [samples[i] for i in chunk]
    if len(rows) > 1 and all(s.prompt_ids == rows[0].prompt_ids for s in rows):
        return len(rows[0].prompt_ids) + len(rows) * max(len(s.completion_ids) for s in rows)
    return len(rows) * (max(len(s.prompt_ids) for s in rows) + max(len(s.completion_ids) for s in rows))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(1, 120), min_size=1, max_size=9)), min_size=1, max_size=6
    ),
    size=st.none() | st.integers(1, 9),
    tokens=st.none() | st.integers(1, 900),
    seed=st.integers(0, 2**16),
)
def test_the_planner_covers_every_sample_once_within_its_caps_whatever_the_input_order(groups, size, tokens, seed):
    import random

    samples = planner_samples(groups)
    plan = plan_micro_batches(samples, size=size, tokens=tokens)
    assert sorted(i for chunk in plan for i in chunk) == list(range(len(samples)))
    for chunk in plan:
        assert chunk and (len(chunk) == 1 or size is None or len(chunk) <= size)
        assert len(chunk) == 1 or tokens is None or padded_tokens(samples, chunk) <= tokens
    prompts = [tuple(samples[chunk[0]].prompt_ids) for chunk in plan]
    for prompt in set(prompts):  # a group's micro-batches hold only it, and come one after another
        if sum(tuple(s.prompt_ids) == prompt for s in samples) > 1:
            at = [i for i, p in enumerate(prompts) if p == prompt]
            assert at == list(range(at[0], at[-1] + 1))
            assert all(tuple(samples[j].prompt_ids) == prompt for i in at for j in plan[i])
    # the same samples in another order: the same micro-batches of the same samples, in the same order
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    shuffled = plan_micro_batches([samples[i] for i in order], size=size, tokens=tokens)
    assert [[samples[order[i]].rollout_id + samples[order[i]].group for i in chunk] for chunk in shuffled] == [
        [samples[i].rollout_id + samples[i].group for i in chunk] for chunk in plan
    ]


def test_the_planner_cuts_a_group_by_length_only_where_padding_outweighs_a_pass():
    from agl.train.micro_batches import PASS_OVERHEAD_TOKENS

    assert 30 < PASS_OVERHEAD_TOKENS < 1000  # what the cases below assume
    # 2 long + 6 short: one pass would pad the short ones to 250 (~1,300 padded tokens); a second pass costs less
    samples = planner_samples([(100, [20, 250, 30, 25, 240, 22, 28, 21])])
    assert plan_micro_batches(samples) == [[1, 4], [2, 6, 3, 5, 7, 0]]
    # lengths close together: one pass
    samples = planner_samples([(100, [200, 210, 190, 205])])
    assert plan_micro_batches(samples) == [[1, 3, 0, 2]]
    # a cap of 100 + 2 x 210 = 520 tokens: pairs, longest first
    assert plan_micro_batches(samples, tokens=520) == [[1, 3], [0, 2]]
    # one sample over the cap by itself still runs, alone
    assert plan_micro_batches(samples, tokens=50) == [[1], [3], [0], [2]]


def lora_grads_after_step(policy, samples, advs, **config) -> tuple[dict, dict]:
    """(metrics, the LoRA's accumulated gradients) of one step that leaves the LoRA as it was."""
    update = GRPOUpdate(
        policy,
        GRPOConfig(**{"loss": {"type": "grpo", "epsilon_high": None}, "lr": 0.0, "max_grad_norm": 1e9, **config}),
    )
    metrics = update.step(samples, advs)
    return metrics, lora_grads(policy)


def two_groups_and_a_single(seed: int) -> tuple[list, list[float]]:
    """Two groups of random prompts and completions (5 and 4 samples, lengths 1-17) and a lone sample, with
    advantages."""
    torch.manual_seed(seed)
    samples = []
    for g, lengths in enumerate([(2, 17, 3, 15, 9), (12, 1, 11, 4)]):
        prompt = torch.randint(10, 2000, (13 + 4 * g,)).tolist()
        samples += make_samples(
            prompt,
            [torch.randint(10, 2000, (n,)).tolist() for n in lengths],
            [1, 0, 0, 1, 0][: len(lengths)],
            group=f"g{g}",
        )
    samples += make_samples(torch.randint(10, 2000, (6,)).tolist(), [[5, 6, 7]], [1.0], group="single")
    return samples, [0.5, -1.0, 0.25, 1.5, -0.75, 1.0, -0.5, 0.8, -1.2, 0.3]


@pytest.mark.parametrize("output", ["fused", "head module", "model logits"])
def test_a_group_cut_into_micro_batches_gives_the_loss_and_gradients_of_one_pass(policy, output, monkeypatch):
    """Groups cut into parts (the shared prompt run once, its gradient summed over the parts)
    against the same groups in one pass each (the planner before token budgets), with the
    recomputed old log-probs and the reference pass (beta) going through the cut too."""
    import agl.train.forward

    if output != "fused":
        monkeypatch.setattr(agl.train.forward, "fused_head", lambda policy: None)
    if output == "model logits":
        monkeypatch.setattr(agl.train.forward, "_head_gives_logits", lambda policy: False)
    samples, advs = two_groups_and_a_single(seed=3)
    config = dict(beta=0.1, old_logprobs="recompute")
    whole_plan = plan_micro_batches(samples)
    assert len(whole_plan) == 3  # each group in one pass, and the single
    whole, whole_grads = lora_grads_after_step(policy, samples, advs, micro_batch_tokens=None, **config)
    cut_plan = plan_micro_batches(samples, tokens=40)
    assert len(cut_plan) > 6
    cut, cut_grads = lora_grads_after_step(policy, samples, advs, micro_batch_tokens=40, **config)
    for key in ("loss", "train_tokens", "kl", "ratio_mean", "entropy", "logprob_diff_abs"):
        assert cut[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    assert cut["train_input_tokens"] == whole["train_input_tokens"]  # each prompt still runs once
    assert whole_grads.keys() == cut_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        torch.testing.assert_close(cut_grads[name], grad, atol=1e-6, rtol=1e-4)


def test_micro_batch_keys_default_alike_in_grpo_config_and_the_yaml():
    yaml = compose_checked(
        str(Path(__file__).parent.parent / "conf"), ["algo=grpo"]
    ).algo  # composed: the keys live in GRPOConfig
    config = GRPOConfig.from_cfg({k: yaml[k] for k in ("micro_batch_size", "micro_batch_tokens")})
    default = GRPOConfig()
    assert (config.micro_batch_size, config.micro_batch_tokens) == (
        default.micro_batch_size,
        default.micro_batch_tokens,
    )


@pytest.mark.parametrize("micro_batch_tokens", [None, 40])
def test_gradient_checkpointing_gives_the_loss_and_gradients_of_kept_activations(
    policy, micro_batch_tokens, monkeypatch
):
    """Decoder layers replayed in backward (agl/train/activation_checkpointing.py) against activations kept: the same
    loss, metrics and LoRA gradients, for groups in one pass each (the prompt's KV cache built inside
    the checkpointed layers) and for groups cut into parts (completions run against the prompt's cache)."""
    import agl.train.activation_checkpointing
    from agl.train.activation_checkpointing import decoder_layers

    replays = []
    real_checkpoint = agl.train.activation_checkpointing.checkpoint
    monkeypatch.setattr(
        agl.train.activation_checkpointing, "checkpoint", lambda *a, **k: replays.append(1) or real_checkpoint(*a, **k)
    )
    samples, advs = two_groups_and_a_single(seed=4)
    config = dict(micro_batch_tokens=micro_batch_tokens)
    kept, kept_grads = lora_grads_after_step(policy, samples, advs, gradient_checkpointing=False, **config)
    assert not replays
    replayed, replayed_grads = lora_grads_after_step(policy, samples, advs, gradient_checkpointing=True, **config)
    assert len(replays) >= len(decoder_layers(policy.model)) * 3  # every layer, in every pass
    assert all("forward" not in vars(layer) for layer in decoder_layers(policy.model))  # the layers are as they were
    for key in ("loss", "train_tokens", "entropy", "logprob_diff_abs", "grad_norm"):
        assert replayed[key] == pytest.approx(kept[key], rel=1e-6, abs=1e-7), key
    assert kept_grads.keys() == replayed_grads.keys() and kept_grads
    for name, grad in kept_grads.items():
        torch.testing.assert_close(replayed_grads[name], grad, atol=1e-7, rtol=1e-5)
