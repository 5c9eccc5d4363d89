"""LoRA on the vocabulary matrices (model.lora.train_embeddings / train_head), tied and untied.

Each case trains two GRPO steps on the tiny model (two: a LoRA's zero-initialised half gets no
gradient in the first), then checks what must still hold downstream: the new LoRA trained, the
merged sampler decodes with the training model's log-probs, and the adapter and a checkpoint
restore it exactly.
"""

import asyncio
import re

import pytest
import torch
from omegaconf import OmegaConf
from peft import LoraConfig
from safetensors import safe_open

from agl.config import GRPOConfig
from agl.policy.engine import Engine, SamplingParams
from agl.policy.load import load_policy
from agl.policy.lora import lora_config, tied_lora_aliases, with_targets
from agl.policy.sampler_weights import MergedSampler
from agl.policy.weights import resolve_model_path
from agl.train.forward import completion_logprobs, fused_head
from agl.train.grpo import GRPOUpdate
from agl.train.resume import adapter_bytes, load_adapter_bytes
from agl.train.samples import Sample
from agl.train.token_batch import TokenBatch

PROMPT = list(range(100, 120))
IDS = torch.tensor([PROMPT + [5, 6, 7]])  # tokens the training steps saw: their embedding rows have a LoRA delta
CASES = {  # name: (tie_word_embeddings, train_embeddings, train_head)
    "tied": (True, True, False),
    "untied-both": (False, True, True),
    "untied-embeddings": (False, True, False),  # the head stays plain: the fused log-prob head is used
}
LINEAR_LORA = 16_384  # r=8 on the 14 linear layers of the tiny model
VOCABULARY_LORA = 8 * (49_152 + 64)  # r x (vocabulary + hidden), per vocabulary matrix


def variant(cfg, **changes):
    cfg = cfg.copy()
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def case_cfg(tiny_model_cfg, case):
    tie, embeddings, head = CASES[case]
    return variant(
        tiny_model_cfg,
        **{"tiny.tie_word_embeddings": tie, "lora.train_embeddings": embeddings, "lora.train_head": head},
    )


def vocabulary_lora(policy) -> dict[str, torch.nn.Parameter]:
    """The LoRA parameters on the embeddings and the head, by name (a tied LoRA's aliases included)."""
    return {
        n: p for n, p in policy.model.named_parameters() if p.requires_grad and ("embed_tokens" in n or "lm_head" in n)
    }


def samples():
    """One GRPO group of four completions of PROMPT (old log-probs are recomputed by the update)."""
    completions = [[5, 6, 7], [8, 9], [10], [11, 12]]
    return [
        Sample(
            rollout_id=f"r{i}",
            prompt_ids=PROMPT,
            completion_ids=c,
            mask=[1] * len(c),
            logprobs=[-1.0] * len(c),
            reward=float(i in (0, 3)),
            truncated=False,
            temperature=1.0,
            group="g",
        )
        for i, c in enumerate(completions)
    ]


def logits(policy):
    with torch.no_grad():
        return policy.model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def bare_base(tiny_model_cfg):
    """The tiny model before peft wraps it (unquantized: only its module names and types matter)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path(tiny_model_cfg.path, tiny_model_cfg.cache_dir, tiny_model_cfg.tiny)
    )


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tiny_model_cfg):
    """(case, cfg, policy after two GRPO steps, its vocabulary LoRA before them)."""
    cfg = case_cfg(tiny_model_cfg, request.param)
    policy = load_policy(cfg, "cpu")
    before = {n: p.detach().clone() for n, p in vocabulary_lora(policy).items()}
    update = GRPOUpdate(
        policy,
        GRPOConfig(lr=1e-2, loss={"type": "grpo", "epsilon_high": None}, micro_batch_size=4, old_logprobs="recompute"),
    )
    for _ in range(2):
        update.step(samples(), [1.0, -1.0, -1.0, 1.0])
    return request.param, cfg, policy, before


def test_defaults_build_the_same_lora_config_as_before(tiny_model_cfg, bare_base):
    policy = load_policy(tiny_model_cfg, "cpu")  # no train_* keys at all, like an older config
    before = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    ).to_dict()
    off = variant(tiny_model_cfg, **{"lora.train_embeddings": False, "lora.train_head": False}).lora
    assert lora_config(tiny_model_cfg.lora, bare_base).to_dict() == before
    assert lora_config(off, bare_base).to_dict() == before
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable) and all("_proj." in n for n in trainable)
    assert policy.parameter_counts()[0] == LINEAR_LORA


def test_extra_targets_extend_each_form_of_target_modules(bare_base):
    extra = ["model.embed_tokens"]
    assert with_targets("all-linear", [], bare_base) == "all-linear"
    assert with_targets(["q_proj"], extra, bare_base) == ["q_proj", "model.embed_tokens"]
    expanded = with_targets("all-linear", extra, bare_base)
    assert len(expanded) == 15 and "lm_head" not in expanded and expanded[-1] == "model.embed_tokens"
    regex = re.compile(with_targets(r".*\.(q|v)_proj", extra, bare_base))
    assert regex.fullmatch("model.layers.0.self_attn.q_proj") and regex.fullmatch("model.embed_tokens")
    assert not regex.fullmatch("model.layers.0.self_attn.k_proj")


def test_on_tied_embeddings_either_option_builds_the_one_shared_lora(tiny_model_cfg, bare_base):
    configs = [
        lora_config(variant(tiny_model_cfg, **{f"lora.{key}": True}).lora, bare_base).to_dict()
        for key in ("train_embeddings", "train_head")
    ]
    assert configs[0] == configs[1]
    assert configs[0]["ensure_weight_tying"] and "model.embed_tokens" in configs[0]["target_modules"]


def test_the_vocabulary_lora_trains_once_per_matrix(trained):
    case, _, policy, before = trained
    tie, _, head = CASES[case]
    matrices = 1 if tie else 1 + head
    assert policy.parameter_counts()[0] == LINEAR_LORA + matrices * VOCABULARY_LORA
    after = vocabulary_lora(policy)
    assert after and all(not torch.equal(after[n], before[n]) for n in after), "every new LoRA tensor changed"
    base = policy.model.get_base_model()
    assert (
        not base.get_input_embeddings().weight.requires_grad and not base.get_output_embeddings().weight.requires_grad
    )
    aliases = tied_lora_aliases(policy.model)
    assert len(aliases) == (2 if tie else 0)
    assert (fused_head(policy) is None) == (tie or head)  # a LoRA-wrapped head computes its own logits
    trainable = {id(p) for p in policy.trainable_parameters()}
    for alias, owner in aliases:  # still one storage, stepped once: only the owner is in the optimizer
        assert alias.data_ptr() == owner.data_ptr() and torch.equal(alias, owner.t())
        assert id(alias) not in trainable and id(owner) in trainable


def test_a_tied_lora_gets_the_sum_of_both_roles_gradients(tiny_model_cfg):
    policy = load_policy(case_cfg(tiny_model_cfg, "tied"), "cpu")
    with torch.no_grad():  # away from the zero init, so both roles pass gradient to both halves
        for p in vocabulary_lora(policy).values():
            p.normal_(0, 0.1)
    batch = TokenBatch.build(samples(), pad_id=2, mask_truncated=False)
    pairs = tied_lora_aliases(policy.model)
    loss = completion_logprobs(policy, batch)[0].sum()
    separate = torch.autograd.grad(loss, [p for pair in pairs for p in pair], retain_graph=True)
    loss.backward()
    for (alias, owner), g_alias, g_owner in zip(pairs, separate[0::2], separate[1::2]):
        assert g_alias.abs().sum() > 0 and g_owner.abs().sum() > 0
        assert alias.grad is None
        torch.testing.assert_close(owner.grad, g_owner + g_alias.t())


def test_a_tied_lora_stays_one_matrix_through_the_fp32_upcast(tiny_model_cfg):
    """Unquantized bf16: peft's autocast and the fp32 upcast copy each LoRA tensor on its own."""
    cfg = variant(case_cfg(tiny_model_cfg, "tied"), quantization="none", compute_dtype="bfloat16")
    policy = load_policy(cfg, "cpu")
    pairs = tied_lora_aliases(policy.model)
    assert len(pairs) == 2
    for alias, owner in pairs:
        assert alias.dtype == owner.dtype == torch.float32 and alias.data_ptr() == owner.data_ptr()


async def decode(policy, max_tokens=12):
    """Two sampled continuations of PROMPT; a failed engine step surfaces from ``stop`` after the timeout."""
    engine = Engine(policy)  # engine.weights=merged: the dense sampling copy
    await engine.start()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True)
        seqs = engine.submit(PROMPT, params, n=2)
        return await asyncio.wait_for(asyncio.gather(*(seq.wait() for seq in seqs)), timeout=20)
    finally:
        await engine.stop()


def test_the_merged_sampler_decodes_with_the_training_log_probs(trained):
    _, _, policy, _ = trained
    policy.model.eval()
    seqs = asyncio.run(decode(policy))
    decoded = [
        Sample(
            rollout_id=str(i),
            prompt_ids=PROMPT,
            completion_ids=s.token_ids,
            mask=[1] * len(s.token_ids),
            logprobs=s.logprobs,
            reward=0.0,
            truncated=False,
            temperature=1.0,
            group="g",
        )
        for i, s in enumerate(seqs)
    ]
    batch = TokenBatch.build(decoded, pad_id=2, mask_truncated=False)
    with torch.no_grad():
        training = completion_logprobs(policy, batch)[0]
    torch.testing.assert_close(batch.old_logp_BT, training, atol=1e-4, rtol=0)


def test_the_merged_sampler_follows_the_reference_switch(trained):
    _, _, policy, _ = trained
    merged = MergedSampler(policy.model, policy.compute_dtype)
    with torch.no_grad():
        torch.testing.assert_close(merged.model()(input_ids=IDS).logits, logits(policy), atol=1e-4, rtol=1e-4)
        with policy.reference():
            torch.testing.assert_close(merged.model()(input_ids=IDS).logits, logits(policy), atol=1e-4, rtol=1e-4)


def test_save_adapter_and_load_it_into_a_fresh_policy(trained, tmp_path):
    _, cfg, policy, _ = trained
    policy.save_adapter(tmp_path)
    loaded = load_policy(variant(cfg, adapter=str(tmp_path)), "cpu")
    assert torch.equal(logits(loaded), logits(policy))
    assert loaded.parameter_counts() == policy.parameter_counts()
    assert len(tied_lora_aliases(loaded.model)) == len(tied_lora_aliases(policy.model))
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        assert not any("base_layer" in k for k in f.keys()), "no base embedding matrix in the adapter"


def test_a_checkpoint_restores_the_vocabulary_lora_exactly(trained):
    _, cfg, policy, _ = trained
    fresh = load_policy(cfg, "cpu")
    assert not torch.equal(logits(fresh), logits(policy))
    load_adapter_bytes(fresh, adapter_bytes(policy))
    got, want = vocabulary_lora(fresh), vocabulary_lora(policy)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert torch.equal(logits(fresh), logits(policy))
    for alias, owner in tied_lora_aliases(fresh.model):  # still one matrix after the restore
        assert alias.data_ptr() == owner.data_ptr()
