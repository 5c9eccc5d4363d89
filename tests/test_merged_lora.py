"""LoRA layers run merged in the update (agl/train/merged_lora.py): peft's values and gradients, the sampler's
weights."""

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from agl.config import GRPOConfig
from agl.errors import ConfigError
from agl.policy.load import load_policy
from agl.policy.lora import resolve_train_merged as resolve
from agl.policy.sampler_weights import base_weight, dense_linear
from agl.train import merged_lora
from agl.train.grpo import GRPOUpdate
from agl.train.merged_lora import (
    _merged,
    _plain_adapter,
    dequantizable_4bit_layers,
    merged_layers,
    merged_lora_layers,
)
from agl.train.sft import sft_loss_and_backward
from tests.test_grpo_update import lora_grads, two_groups_and_a_single


def trained_policy(cfg):
    """A tiny policy whose LoRA B is not zero, as after some training (a fresh B makes the LoRA product vanish)."""
    policy = load_policy(cfg, "cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return policy


@pytest.fixture(scope="module", params=["nf4", "fp4", "none"])
def policy(request, tiny_model_cfg):
    return trained_policy(OmegaConf.merge(tiny_model_cfg, {"quantization": request.param}))


def step_grads(policy, merged: bool, dequantize_once: bool = False, **config) -> tuple[dict, dict]:
    """(metrics, LoRA gradients) of one GRPO step over two groups cut into micro-batches and a single,
    with the recomputed old log-probs and the reference pass, that leaves the LoRA as it was."""
    policy.model.zero_grad(set_to_none=True)
    samples, advs = two_groups_and_a_single(seed=5)
    cfg = {
        "loss": {"type": "grpo", "epsilon_high": None},
        "lr": 0.0,
        "max_grad_norm": 1e9,
        "micro_batch_tokens": 40,
        "beta": 0.1,
        "old_logprobs": "recompute",
        **config,
    }
    policy = dataclasses.replace(policy, train_merged=merged, dequantize_once=dequantize_once)
    metrics = GRPOUpdate(policy, GRPOConfig(**cfg)).step(samples, advs)
    return metrics, lora_grads(policy)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_merged_update_gives_peft_loss_and_gradients(policy, checkpointing):
    peft, peft_grads = step_grads(policy, merged=False, gradient_checkpointing=checkpointing)
    merged, merged_grads = step_grads(policy, merged=True, gradient_checkpointing=checkpointing)
    for key in ("loss", "kl", "ratio_mean", "entropy", "logprob_diff_abs"):
        assert merged[key] == pytest.approx(peft[key], rel=1e-5, abs=1e-6), key
    assert merged_grads.keys() == peft_grads.keys() and len(peft_grads) == 2 * len(merged_layers(policy.model))
    for name, grad in peft_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(merged_grads[name], grad, atol=1e-6, rtol=1e-4)


SFT_EXAMPLES = [
    ([1, 9690, 198, 4093, 314, 253, 1345, 2, 77, 78], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]),
    ([1, 55, 66, 77, 2], [0, 0, 1, 1, 1]),
]


def sft_grads(policy, **replaced) -> tuple[float, dict]:
    """(loss, LoRA gradients) of one SFT step over ``SFT_EXAMPLES`` with ``policy``'s fields ``replaced``."""
    policy.model.zero_grad(set_to_none=True)
    stats = sft_loss_and_backward(
        dataclasses.replace(policy, **replaced), SFT_EXAMPLES, micro_batch_size=1, gradient_checkpointing=True
    )
    return stats["loss"], lora_grads(policy)


@pytest.mark.parametrize(
    "quantization, double_quant, compute_dtype",
    [("nf4", False, "bfloat16"), ("fp4", False, "bfloat16"), ("nf4", True, "bfloat16"), ("nf4", False, "float32")],
)
def test_4bit_weights_dequantized_once_give_the_same_bits(
    tiny_model_cfg, quantization, double_quant, compute_dtype, monkeypatch
):
    """peft's LoRA: each 4-bit weight dequantized once for the step (dequantized_4bit_layers) gives the loss and
    the gradients of bitsandbytes' dequantize in every forward, replay and backward, bit for bit: a GRPO step
    (with its reference pass) and an SFT step."""
    cfg = OmegaConf.merge(
        tiny_model_cfg, {"quantization": quantization, "double_quant": double_quant, "compute_dtype": compute_dtype}
    )
    policy = trained_policy(cfg)
    assert policy.dequantize_once  # on a CPU
    layers = dequantizable_4bit_layers(policy.model)
    assert len(layers) == len(merged_layers(policy.model))
    dequantized = []
    monkeypatch.setattr(merged_lora, "base_weight", lambda layer: dequantized.append(layer) or base_weight(layer))
    runs = [step_grads(policy, merged=False, dequantize_once=once, gradient_checkpointing=True) for once in (0, 1)]
    assert len(dequantized) == len(layers)  # once each, over the step's 4 passes, replays and backwards
    (metrics, grads), (once_metrics, once_grads) = runs
    for key in ("loss", "kl", "ratio_mean", "entropy", "logprob_diff_abs"):
        assert once_metrics[key] == metrics[key], key
    assert grads.keys() == once_grads.keys()
    for name, grad in grads.items():
        assert grad.abs().max() > 0 and torch.equal(once_grads[name], grad), name
    assert not any("forward" in layer.__dict__ for layer in layers)  # the step's cache is gone
    sft = [sft_grads(policy, train_merged=False, dequantize_once=once) for once in (False, True)]
    assert sft[1][0] == sft[0][0]
    for name, grad in sft[0][1].items():
        assert grad.abs().max() > 0 and torch.equal(sft[1][1][name], grad), name


def test_a_merged_sft_step_gives_peft_loss_and_gradients(policy):
    # peft's side as bitsandbytes runs it: each pass dequantizes
    results = {merged: sft_grads(policy, train_merged=merged, dequantize_once=False) for merged in (False, True)}
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, atol=1e-6, rtol=1e-4)


def test_the_merged_weight_is_the_samplers_bit_for_bit(policy):
    for layer in merged_layers(policy.model):
        A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        merged = _merged(layer.get_base_layer(), A, B, layer.scaling["default"], torch.float32)
        assert torch.equal(merged, dense_linear(layer, torch.float32).weight)


def test_what_peft_would_run_otherwise_keeps_peft_forward(tiny_model_cfg):
    policy = trained_policy(OmegaConf.merge(tiny_model_cfg, {"lora": {"dropout": 0.1}}))
    layer = merged_layers(policy.model)[0]
    policy.model.train()
    assert _plain_adapter(layer) is None  # dropout on in training
    policy.model.eval()
    assert _plain_adapter(layer) == "default"  # dropout is off in eval
    with policy.reference():
        assert _plain_adapter(layer) is None  # the adapter switched off: the base layer alone
        x = torch.randn(3, layer.in_features)
        with merged_lora_layers(policy.model):
            assert torch.equal(layer(x), layer.get_base_layer()(x))


def test_8bit_layers_keep_peft_forward(tiny_model_cfg):
    """bitsandbytes' int8 matmul quantizes the input too: a merged layer would compute something else."""
    policy = load_policy(OmegaConf.merge(tiny_model_cfg, {"quantization": "int8"}), "cpu")
    assert merged_layers(policy.model) == []


def test_the_context_installs_and_removes_the_merged_forward(policy):
    layers = merged_layers(policy.model)
    head = policy.model.get_base_model().get_output_embeddings()
    assert layers and head not in layers
    with merged_lora_layers(policy.model):
        assert all("forward" in layer.__dict__ for layer in layers)
    assert not any("forward" in layer.__dict__ for layer in layers)
    with merged_lora_layers(policy.model, enabled=False):
        assert not any("forward" in layer.__dict__ for layer in layers)


def test_auto_merges_in_float32_only():
    assert resolve("auto", torch.float32) is True
    assert resolve("auto", torch.bfloat16) is False
    assert resolve(True, torch.bfloat16) is True and resolve(False, torch.float32) is False
    with pytest.raises(ConfigError, match="train_merged"):
        resolve("yes", torch.float32)
