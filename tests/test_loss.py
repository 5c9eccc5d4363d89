"""GRPO losses against values computed by hand, gradient accumulation == one batch, and the registries of losses
and advantage estimators."""

import dataclasses
import math

import pytest
import torch

from agl.errors import ConfigError
from agl.train.advantages import ESTIMATORS, register_advantage
from agl.train.loss import (
    LOSSES,
    LossInputs,
    TokenTerms,
    micro_batch_loss,
    register_loss,
    resolve_loss,
    token_weights,
)


def policy_loss(logp, old, adv, mask, weights, loss_type="grpo", beta=0.0, ref_logp_BT=None, **params):
    """One micro-batch's loss under ``algo.loss={type: loss_type, **params}``; the clip range is symmetric unless
    ``epsilon_high`` is given."""
    if loss_type in ("grpo", "dr_grpo", "dapo", "gspo", "cispo"):
        params.setdefault("epsilon_high", None)
    loss, loss_params = resolve_loss({"type": loss_type, **params})
    return micro_batch_loss(loss, loss_params, LossInputs.of(logp, old, adv, mask), weights, beta, ref_logp_BT)


def weights_of(mask, loss_type, max_length):
    return token_weights(mask, LOSSES.get(loss_type).weighting, max_length)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


def test_token_weights_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert weights_of(mask, "grpo", 3).tolist() == [[0.25, 0.25, 0.0], [0.5, 0.0, 0.0]]
    close(weights_of(mask, "dr_grpo", 3), [[1 / 6, 1 / 6, 0.0], [1 / 6, 0.0, 0.0]])
    close(weights_of(mask, "dapo", 3), [[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]])
    # sapo averages per sequence as the SAPO paper and TRL do; cispo and opmd per token (MiniMax-M1, Trinity)
    assert weights_of(mask, "sapo", 3).tolist() == weights_of(mask, "grpo", 3).tolist()
    for loss_type in ("cispo", "opmd"):
        assert weights_of(mask, loss_type, 3).tolist() == weights_of(mask, "dapo", 3).tolist()
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        token_weights(mask, "ppo", 3)
    with pytest.raises(ConfigError, match="algo.loss.type='ppo' is not a registered loss"):
        policy_loss(mask, mask, torch.zeros(2), mask, mask, loss_type="ppo")


def test_on_policy_grpo_loss_is_minus_mean_advantage():
    # ratio 1: per-token loss = -A; grpo averages tokens per sequence, then sequences.
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, weights_of(mask, "grpo", 3))
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
    loss, stats = policy_loss(
        logp, old, torch.tensor([1.0]), mask, weights_of(mask, "gspo", 2), loss_type="gspo", epsilon=0.05
    )
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


def test_cispo_by_hand_clips_the_weight_not_the_gradient():
    # token 0: r = e^0.5 = 1.6487 > 1.28, weight capped to 1.28; token 1: r = 1, weight 1. A = 1.
    # per-token -sg(w) * A * logp: -1.28 * 0 = 0 and -1 * -1 = 1; cispo weights 1/2 each -> loss 0.5.
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-0.5, -1.0]])
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(
        logp,
        old,
        torch.tensor([1.0]),
        mask,
        weights_of(mask, "cispo", 2),
        loss_type="cispo",
        epsilon=0.2,
        epsilon_high=0.28,
    )
    assert float(loss.detach()) == pytest.approx(0.5)
    assert float(stats["clip_ratio_high"]) == 0.5 and float(stats["clip_ratio_low"]) == 0.0
    loss.backward()
    # d/dlogp = -w * A * 1/2: the clipped token keeps -1.28/2 = -0.64. Token 1 gets -1/2; without
    # the stop-gradient it would be -A * d(r logp)/dlogp / 2 = -(r logp + r)/2 = 0 at logp = -1.
    assert logp.grad.tolist()[0] == pytest.approx([-0.64, -0.5])

    # PPO-clip on the same tokens: the clipped token has no gradient at all.
    logp.grad = None
    loss, _ = policy_loss(
        logp,
        old,
        torch.tensor([1.0]),
        mask,
        weights_of(mask, "dapo", 2),
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
    )
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.5])


def test_cispo_lower_bound_only_when_epsilon_is_below_one():
    # r = e^-0.5 = 0.6065, A = -1, one token: per-token -w * A * logp = w * logp, logp = -1 -> -w.
    logp = torch.tensor([[-1.0]], requires_grad=True)
    old = torch.tensor([[-0.5]])
    mask = torch.ones(1, 1)
    loss, stats = policy_loss(logp, old, torch.tensor([-1.0]), mask, mask, loss_type="cispo", epsilon=0.2)
    assert float(loss.detach()) == pytest.approx(-0.8)  # weight raised to 1 - 0.2
    assert float(stats["clip_ratio_low"]) == 1.0
    loss.backward()
    assert float(logp.grad) == pytest.approx(0.8)  # -w * A, kept although PPO-clip would drop it
    loss, stats = policy_loss(logp.detach(), old, torch.tensor([-1.0]), mask, mask, loss_type="cispo", epsilon=1.0)
    assert float(loss.detach()) == pytest.approx(-math.exp(-0.5))  # no lower bound: w = r
    assert float(stats["clip_ratio_low"]) == 0.0


def test_sapo_on_policy_by_hand_has_the_grpo_gradient():
    # r = 1: gate sigmoid(0) * 4 / tau = 2 / tau. A = [2, -1], tau_pos = 1, tau_neg = 1.05.
    # per-token -gate * A: -2 * 2 = -4 and -(2 / 1.05) * -1 = 1.90476; sapo weights 1/2 each.
    logp = torch.tensor([[-1.0], [-2.0]], requires_grad=True)
    mask = torch.ones(2, 1)
    adv = torch.tensor([2.0, -1.0])
    w = weights_of(mask, "sapo", 1)
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, w, loss_type="sapo", tau_pos=1.0, tau_neg=1.05)
    assert float(loss.detach()) == pytest.approx((-4.0 + 2 / 1.05) / 2)
    assert float(stats["clip_ratio_low"]) == 0.0 and float(stats["clip_ratio_high"]) == 0.0
    loss.backward()
    # d gate / d logp = 4 s (1 - s) r = 1 at r = 1 whatever tau: the gradient is -A * weight, as grpo's
    sapo_grad = logp.grad.clone()
    assert sapo_grad[:, 0].tolist() == pytest.approx([-1.0, 0.5])
    logp.grad = None
    grpo_loss, _ = policy_loss(logp, logp.detach(), adv, mask, w, loss_type="grpo")
    grpo_loss.backward()
    torch.testing.assert_close(sapo_grad, logp.grad)


def test_sapo_gate_is_smooth_past_the_clip_range():
    def sig(x):
        return 1 / (1 + math.exp(-x))

    mask = torch.ones(1, 1)
    for log_r, adv, tau in ((0.5, 1.0, 1.0), (2.0, 1.0, 1.0), (0.5, -1.0, 2.0)):
        # r = e^log_r is outside [0.8, 1.28]: PPO-clip gives no gradient for A > 0 there.
        r = math.exp(log_r)
        logp = torch.tensor([[0.0]], requires_grad=True)
        old = torch.tensor([[-log_r]])
        loss, _ = policy_loss(logp, old, torch.tensor([adv]), mask, mask, loss_type="sapo", tau_pos=1.0, tau_neg=tau)
        s = sig(tau * (r - 1))  # tau_pos = 1 for A > 0, tau_neg = tau for A < 0
        assert float(loss.detach()) == pytest.approx(-s * 4 / tau * adv)
        loss.backward()
        # d/dlogp (-gate * A) = -A * 4 s (1 - s) r: e.g. -1.4867 at r = e^0.5, -0.0495 at r = e^2
        assert float(logp.grad) == pytest.approx(-adv * 4 * s * (1 - s) * r, rel=1e-4)  # float32 1 - s
        assert float(logp.grad) != 0.0
    # e^0.5 by hand: s = sigmoid(0.64872) = 0.65672, 4 s (1 - s) r = 4 * 0.65672 * 0.34328 * 1.64872 = 1.4867
    logp = torch.tensor([[0.0]], requires_grad=True)
    policy_loss(logp, torch.tensor([[-0.5]]), torch.tensor([1.0]), mask, mask, loss_type="sapo")[0].backward()
    assert float(logp.grad) == pytest.approx(-1.4867, abs=1e-4)


def test_opmd_by_hand_ignores_the_old_policy():
    # per-token -A * logp / (1 + tau), tau = 1; opmd weights: 1/3 per sampled token.
    # seq 0 (A = 2): -2 * -1 / 2 = 1 and -2 * -2 / 2 = 2; seq 1 (A = -1): 1 * -0.5 / 2 = -0.25.
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    w = weights_of(mask, "opmd", 3)
    loss, stats = policy_loss(logp, logp.detach() - 0.7, adv, mask, w, loss_type="opmd", tau=1.0)
    assert float(loss.detach()) == pytest.approx((1.0 + 2.0 - 0.25) / 3)
    assert float(stats["ratio_mean"]) == pytest.approx(math.exp(0.7))  # logged, not used
    loss.backward()
    # d/dlogp = -A / (1 + tau) / 3
    close(logp.grad, [[-1 / 3, -1 / 3, 0.0], [1 / 6, 0.0, 0.0]])
    # the old log-probs do not enter (Trinity: "NOT USED"); tau = 0 is plain REINFORCE, twice the loss
    same, _ = policy_loss(logp.detach(), logp.detach() + 3.0, adv, mask, w, loss_type="opmd", tau=1.0)
    assert float(same) == pytest.approx(float(loss.detach()))
    double, _ = policy_loss(logp.detach(), logp.detach(), adv, mask, w, loss_type="opmd", tau=0.0)
    assert float(double) == pytest.approx(2 * float(loss.detach()))


@pytest.mark.parametrize("loss_type", LOSSES.names())
def test_micro_batches_accumulate_to_the_full_batch(loss_type):
    torch.manual_seed(0)
    logp = torch.randn(6, 5, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(6)
    weights = weights_of(mask, loss_type, 5)
    full, _ = policy_loss(logp, old, adv, mask, weights, loss_type=loss_type)
    parts = sum(
        policy_loss(
            logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], weights[i : i + 2], loss_type=loss_type
        )[0]
        for i in (0, 2, 4)
    )
    assert float(parts.detach()) == pytest.approx(float(full.detach()), rel=1e-6)


def test_advantage_estimators_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    batch = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    std = float(r.std())  # unbiased: 0.5774
    assert ESTIMATORS.get("grpo")(r, batch).tolist() == pytest.approx(
        [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4)]
    )
    assert ESTIMATORS.get("dr_grpo")(r, batch).tolist() == [0.5, -0.5, -0.5, 0.5]
    batch_std = float(batch.std())
    assert ESTIMATORS.get("grpo_batch")(r, batch).tolist() == pytest.approx(
        [0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), 0.5 / (batch_std + 1e-4)]
    )
    # leave-one-out: 1 - mean(0, 0, 1) = 2/3, 0 - mean(1, 0, 1) = -2/3
    assert ESTIMATORS.get("rloo")(r, batch).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_the_registries_name_what_they_lack_and_check_a_losss_parameters():
    with pytest.raises(ConfigError, match=r"algo.advantage='mean' is not a registered advantage estimator \(grpo \|"):
        ESTIMATORS.get("mean")
    with pytest.raises(ConfigError, match="algo.loss.tau_pos: not a parameter of loss 'dapo' \\(it takes: epsilon, "):
        resolve_loss({"type": "dapo", "tau_pos": 1.0})
    with pytest.raises(ConfigError, match="algo.loss.tau_pos: Value 'hot'"):
        resolve_loss({"type": "sapo", "tau_pos": "hot"})
    with pytest.raises(ConfigError, match="cannot import 'no_such_module:fn'"):
        resolve_loss({"type": "no_such_module:fn"})
    # a plain function is not a loss: the decorator says how its terms are weighted and what it takes
    with pytest.raises(ConfigError, match=r"algo.loss.type='math:sqrt' is a builtin_function_or_method, not a loss"):
        resolve_loss({"type": "math:sqrt"})
    loss, params = resolve_loss({"type": "sapo", "tau_neg": 2})
    assert loss is LOSSES.get("sapo") and (params.tau_pos, params.tau_neg) == (1.0, 2.0)
    with pytest.raises(ValueError, match="registered already"):
        register_loss("sapo")(lambda x, p: TokenTerms(x.logp_BT))
    with pytest.raises(ValueError, match="registered already"):
        register_advantage("rloo")(lambda rewards_G, batch_rewards_N: rewards_G)


def test_a_loss_of_ones_own_is_a_decorated_function_with_its_parameters():
    @dataclasses.dataclass
    class Scale:
        scale: float = 1.0

    @register_loss(params=Scale, weighting="token-mean")  # no name: found as module:function
    def reinforce(x: LossInputs, p: Scale) -> TokenTerms:
        return TokenTerms(-x.adv_BT * x.logp_BT / p.scale)

    assert "reinforce" not in LOSSES.names() and reinforce.weighting == "token-mean"
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    x = LossInputs.of(logp, logp.detach(), adv, mask)
    mine, stats = micro_batch_loss(
        reinforce, reinforce.parameters({"scale": 1.0}), x, token_weights(mask, "token-mean", 3)
    )
    opmd, _ = policy_loss(logp, logp.detach(), adv, mask, weights_of(mask, "opmd", 3), loss_type="opmd", tau=0.0)
    assert float(mine.detach()) == float(opmd.detach()) and float(stats["clip_ratio_low"]) == 0.0
