"""The GRPO update on the tiny model: shared-prompt batching is exact; a step moves only the LoRA."""
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from agl.adapter import Sample
from agl.grpo import GRPOConfig, GRPOUpdate, TokenBatch, advantages, completion_logprobs, plan_micro_batches
from agl.loss import LOSS_TYPES
from agl.model import load_policy


@pytest.fixture(scope="module")
def policy(tiny_model_cfg):
    return load_policy(tiny_model_cfg, "cpu")


def make_samples(prompt, completions, rewards, group="g"):
    return [
        Sample(rollout_id=f"{group}-{i}", prompt_ids=list(prompt), completion_ids=list(c), mask=[1] * len(c),
               logprobs=[-1.0] * len(c), reward=r, truncated=False, temperature=0.7, group=group)
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
    assert plan == [[0, 1], [2], [3, 4]]


def test_one_update_step_changes_only_the_lora_and_drops_zero_std_groups(policy):
    prompt = list(range(100, 120))
    good = make_samples(prompt, [[5, 6, 7], [8, 9], [10], [11, 12]], [1.0, 0.0, 0.0, 1.0], group="good")
    flat = make_samples(prompt[:5], [[5], [6]], [0.5, 0.5], group="flat")
    kept, advs, stats = advantages(good + flat, "group", drop_zero_std=True)
    assert [s.group for s in kept] == ["good"] * 4 and stats["frac_reward_zero_std"] == 0.5
    assert advs[0] > 0 > advs[1]
    frozen = {n: p.detach().clone() for n, p in policy.model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    update = GRPOUpdate(policy, GRPOConfig(lr=1e-2, micro_batch_size=3, old_logprobs="recompute"))
    metrics = update.step(kept, advs)
    assert metrics["train_tokens"] == 8 and metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(torch.equal(p, frozen[n]) for n, p in policy.model.named_parameters() if not p.requires_grad)
    assert any(not torch.equal(p, lora[n]) for n, p in policy.model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "opmd"])
def test_one_update_step_with_each_new_loss_type_changes_the_lora(policy, loss_type):
    prompt = list(range(200, 215))
    samples = make_samples(prompt, [[5, 6, 7], [8, 9], [10], [11, 12]], [1.0, 0.0, 0.0, 1.0], group=loss_type)
    kept, advs, _ = advantages(samples, "group", drop_zero_std=True)
    lora = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    # recorded log-probs (-1.0 here, far from the tiny model's ~-10.8) make the step off-policy,
    # so the clip (cispo) and the gate (sapo) are away from r = 1; opmd ignores them.
    update = GRPOUpdate(policy, GRPOConfig(lr=1e-2, loss_type=loss_type, micro_batch_size=3, epsilon_high=0.28))
    metrics = update.step(kept, advs)
    assert metrics["train_tokens"] == 8
    assert all(map(math.isfinite, (metrics["loss"], metrics["grad_norm"]))) and metrics["grad_norm"] > 0
    if loss_type == "cispo":  # every r = e^(logp + 1) < 0.8: all weights raised to 1 - epsilon, none dropped
        assert metrics["clip_ratio_low"] == 1.0
    assert any(not torch.equal(p, lora[n]) for n, p in policy.model.named_parameters() if p.requires_grad)


def test_loss_coefficients_default_alike_in_grpo_config_and_the_yaml():
    yaml = OmegaConf.load(Path(__file__).parent.parent / "conf" / "algo" / "grpo.yaml")
    config = GRPOConfig.from_cfg({k: yaml[k] for k in ("opmd_tau", "sapo_tau_pos", "sapo_tau_neg")})
    default = GRPOConfig()
    assert (config.opmd_tau, config.sapo_tau_pos, config.sapo_tau_neg) == (default.opmd_tau, default.sapo_tau_pos, default.sapo_tau_neg)
    assert yaml.loss_type in LOSS_TYPES and default.loss_type in LOSS_TYPES
