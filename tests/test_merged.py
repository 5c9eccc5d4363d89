"""The merged sampling model computes what the LoRA policy computes, and follows its updates."""

import pytest
import torch
from helpers import eval_policy

from agl.policy.sampler_weights import DenseLinear, MergedSampler


@pytest.fixture()
def policy(tiny_model_cfg, device):
    return eval_policy(tiny_model_cfg, device)  # NF4 base, fp32 compute: the two paths agree to rounding


IDS = torch.tensor([[1, 9690, 198, 4093, 314, 253, 1345, 2]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS.to(model.device)).logits


def optimizer_step(policy, lr=0.05):
    """What training does to the LoRA: in-place updates of its parameters."""
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=lr)
    logits(policy.model)  # a forward with grad to get a real gradient
    out = policy.model(input_ids=IDS.to(policy.device)).logits
    out[0, -1, :100].sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_merged_model_matches_the_policy_before_and_after_updates(policy):
    merged = MergedSampler(policy.model, policy.compute_dtype)
    torch.testing.assert_close(logits(merged.model()), logits(policy.model), atol=1e-4, rtol=1e-4)
    before = logits(merged.model())
    for _ in range(2):
        optimizer_step(policy)
        torch.testing.assert_close(logits(merged.model()), logits(policy.model), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(before, logits(merged.model()))


def test_a_restored_adapter_is_picked_up(policy):
    merged = MergedSampler(policy.model, policy.compute_dtype)
    start = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    first = logits(merged.model())
    optimizer_step(policy)
    assert not torch.allclose(first, logits(merged.model()))
    policy.model.load_state_dict(start, strict=False)  # a checkpoint restore
    torch.testing.assert_close(logits(merged.model()), first)


def test_reference_context_samples_from_the_base_model(policy):
    optimizer_step(policy)
    merged = MergedSampler(policy.model, policy.compute_dtype)
    with policy.reference():
        base = logits(policy.model)
        torch.testing.assert_close(logits(merged.model()), base, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(merged.model()), base, atol=1e-4)


def test_only_linear_layers_are_replaced_everything_else_is_shared(policy):
    merged = MergedSampler(policy.model, policy.compute_dtype).model()
    source = policy.model.get_base_model()
    dense = {n for n, m in merged.named_modules() if isinstance(m, DenseLinear)}
    assert dense and all(n.endswith(("_proj",)) for n in dense)
    assert merged.get_output_embeddings() is source.get_output_embeddings()
    assert merged.get_input_embeddings() is source.get_input_embeddings()
    assert merged.model.norm is source.model.norm
    assert not any(t.is_meta for t in [*merged.parameters(), *merged.buffers()])
    assert not any(p.requires_grad for p in merged.parameters() if p is not source.get_input_embeddings().weight)


@pytest.mark.parametrize("vocabulary_lora", [False, True], ids=["linear-lora", "with-embedding-and-head-lora"])
def test_the_frozen_base_sampler_ignores_the_adapter_and_its_updates(tiny_model_cfg, device, vocabulary_lora):
    """``lora=False`` (the route's helper models): the base model, however the LoRA is trained,
    without touching the policy's own adapter switch."""
    cfg = tiny_model_cfg.copy()
    cfg.tiny.tie_word_embeddings = not vocabulary_lora  # an untied head can carry its own LoRA
    cfg.lora.train_embeddings = cfg.lora.train_head = vocabulary_lora
    policy = eval_policy(cfg, device)
    frozen = MergedSampler(policy.model, policy.compute_dtype, lora=False)
    for _ in range(2):
        optimizer_step(policy)
    with policy.reference():
        base = logits(policy.model)
    trained = logits(policy.model)
    assert not torch.allclose(trained, base, atol=1e-3)  # the updates moved the policy
    torch.testing.assert_close(logits(frozen.model()), base, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits(policy.model), trained)  # the policy itself is untouched
