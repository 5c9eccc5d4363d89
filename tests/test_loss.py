"""GRPO losses against values computed by hand, and gradient accumulation == one batch."""
import math

import pytest
import torch

from agl.loss import group_advantages, policy_loss, token_weights


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_token_weights_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert token_weights(mask, "grpo", 3).tolist() == [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]
    close(token_weights(mask, "dr_grpo", 3), [[1 / 6, 1 / 6, 0.0], [1 / 6, 0.0, 0.0]])
    close(token_weights(mask, "dapo", 3), [[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]])
    with pytest.raises(ValueError):
        token_weights(mask, "ppo", 3)


def test_on_policy_grpo_loss_is_minus_mean_advantage():
    # ratio 1: per-token loss = -A; grpo averages tokens per sequence, then sequences.
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, token_weights(mask, "grpo", 3))
    assert float(loss.detach()) == pytest.approx(-(2.0 + -1.0) / 2)
    loss.backward()
    # d loss / d logp = -A * weight (ratio' = ratio = 1): -2 * 1/4 and +1 * 1/2
    close(logp.grad, [[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]])
    assert float(stats["clip_ratio_low"]) == 0 and float(stats["clip_ratio_high"]) == 0


def test_clipping_by_hand():
    # one token, ratio e^0.5 = 1.6487 > 1.2 with positive advantage: clipped, no gradient.
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-0.5]])
    mask = torch.ones(1, 1)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, mask, epsilon=0.2)
    assert float(loss.detach()) == pytest.approx(-1.2)
    loss.backward()
    assert float(logp.grad) == 0.0
    assert float(stats["clip_ratio_high"]) == 1.0
    # asymmetric: epsilon_high=0.28 clips at 1.28
    loss, _ = policy_loss(logp.detach(), old, torch.tensor([1.0]), mask, mask, epsilon=0.2, epsilon_high=0.28)
    assert float(loss.detach()) == pytest.approx(-1.28)
    # negative advantage: min picks the unclipped (larger) penalty: -min(1.6487*-1, 1.2*-1) = 1.6487
    loss, _ = policy_loss(logp.detach(), old, torch.tensor([-1.0]), mask, mask)
    assert float(loss.detach()) == pytest.approx(math.exp(0.5))


def test_gspo_uses_sequence_geometric_mean_ratio():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.1, 0.1]])  # token ratios e^0.1, e^-0.1: geometric mean exactly 1
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logp, old, torch.tensor([1.0]), mask, token_weights(mask, "gspo", 2), loss_type="gspo", epsilon=0.05)
    assert float(loss.detach()) == pytest.approx(-1.0)  # not clipped, although each token ratio is outside 1 +- 0.05
    assert float(stats["clip_ratio_high"]) == 0.0
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, -0.5])


def test_k3_kl_by_hand():
    logp = torch.tensor([[-1.0]])
    ref = torch.tensor([[-2.0]])
    mask = torch.ones(1, 1)
    loss, stats = policy_loss(logp, logp, torch.tensor([0.0]), mask, mask, beta=0.5, ref_logp_BT=ref)
    k3 = math.exp(-1.0) - (-1.0) - 1
    assert float(stats["kl"]) == pytest.approx(k3)
    assert float(loss.detach()) == pytest.approx(0.5 * k3)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_micro_batches_accumulate_to_the_full_batch(loss_type):
    torch.manual_seed(0)
    logp = torch.randn(6, 5, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(6)
    weights = token_weights(mask, loss_type, 5)
    full, _ = policy_loss(logp, old, adv, mask, weights, loss_type=loss_type)
    parts = sum(policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], weights[i : i + 2], loss_type=loss_type)[0] for i in (0, 2, 4))
    assert float(parts.detach()) == pytest.approx(float(full.detach()), rel=1e-6)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    std = float(r.std())  # unbiased: 0.5774
    assert group_advantages(r).tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1 + [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4)])
    assert group_advantages(r, "none").tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages(r, "batch", batch_std=1.0).tolist() == pytest.approx([0.5 / 1.0001, -0.5 / 1.0001, -0.5 / 1.0001, 0.5 / 1.0001])
    with pytest.raises(ValueError):
        group_advantages(r, "batch")
