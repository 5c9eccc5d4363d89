"""agl.policy.decode's step computes what the model's forward computes, and the engine samples the same with it:
for the tiny Llama and a tiny Qwen2 (biased q/k/v, the architecture of conf/model/shape_qwen25_*.yaml)."""

import asyncio

import pytest
import torch
from helpers import eval_policy
from test_merged import optimizer_step

from agl.policy.decode import decode_step
from agl.policy.engine import Engine, SamplingParams
from agl.policy.kv_cache import slot_cache
from agl.policy.load import load_policy
from agl.policy.sampler_weights import MergedSampler


@pytest.fixture(params=["llama", "qwen2"])
def policy(request, tiny_model_cfg, device):
    cfg = tiny_model_cfg.copy()
    cfg.tiny.architecture = request.param
    return eval_policy(cfg, device)


def prefilled(model, ids, mask):
    cache = slot_cache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = model(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            position_ids=positions.to(model.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return cache, out.logits[:, -1].argmax(-1)


def decode_both(policy, steps=5):
    """Left-padded rows decoded side by side through the model's forward and through the step."""
    merged = MergedSampler(policy.model, policy.compute_dtype)
    step = decode_step(merged)
    assert step is not None
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40000, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = mask[2, :1] = 0
    (cache_model, tokens), (cache_step, _) = prefilled(merged.model(), ids, mask), prefilled(merged.model(), ids, mask)
    positions = mask.sum(-1)
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        with torch.inference_mode():
            device = policy.device
            expected = (
                merged.model()(
                    input_ids=tokens[:, None].to(device),
                    attention_mask=mask.to(device),
                    position_ids=positions[:, None].to(device),
                    cache=cache_model,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1]
                .float()
                .cpu()
            )
            got = step(tokens, positions, mask, cache_step)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        tokens, positions = expected.argmax(-1), positions + 1
    return merged


def test_the_step_matches_the_model_forward_before_and_after_an_update(policy):
    decode_both(policy)
    optimizer_step(policy)  # the merge is redone and the stacked weights rebuilt from it
    decode_both(policy)


def test_the_stacked_weights_are_views_of_one_matrix(policy):
    merged = decode_both(policy, steps=1)
    attn = merged.model().model.layers[0].self_attn
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()


def test_the_adapter_path_falls_back_to_the_model_forward(policy):
    assert Engine(policy, weights="adapter").decode_step is None
    assert Engine(policy, decode="model").decode_step is None
    assert Engine(policy).decode_step is not None


def test_the_engine_samples_the_same_tokens_and_logprobs_either_way(policy):
    prompts = [
        policy.render_chat([{"role": "user", "content": text}])
        for text in ("Hi", "What is 2 + 2? Think.", "Name a colour")
    ]

    async def run(decode):
        engine = Engine(policy, decode=decode)
        await engine.start()
        try:
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            seqs = [s for p in prompts for s in engine.submit(p, params)]
            sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
            seqs += engine.submit(prompts[1], sampled, n=2)
            await asyncio.gather(*(s.wait() for s in seqs))
        finally:
            await engine.stop()
        return [(s.token_ids, s.logprobs) for s in seqs]

    fast, model = asyncio.run(run("fast")), asyncio.run(run("model"))
    for (tokens_fast, logprobs_fast), (tokens_model, logprobs_model) in zip(fast, model):
        assert tokens_fast == tokens_model
        torch.testing.assert_close(torch.tensor(logprobs_fast), torch.tensor(logprobs_model), atol=1e-5, rtol=0)


def test_few_rows_read_the_nf4_base_plus_the_lora_as_the_trainer_computes(tiny_model_cfg):
    """A bf16 sampler's steps of at most ``quantized_rows`` rows read the NF4 base through bitsandbytes' CPU
    kernel and add the LoRA in float32 (agl.policy.decode.Nf4Projection): the trainer's logits to bf16's
    rounding, as the dense merged weights give them. A float32 sampler never takes that path."""
    from agl.policy.decode import _nf4_applies

    fp32 = load_policy(tiny_model_cfg, "cpu")
    assert decode_step(MergedSampler(fp32.model, fp32.compute_dtype), quantized_rows=8).quantized_rows == 0
    cfg = tiny_model_cfg.copy()
    cfg.compute_dtype = "bfloat16"
    policy = eval_policy(cfg, "cpu")
    merged = MergedSampler(policy.model, policy.compute_dtype)
    if not _nf4_applies(merged):
        pytest.skip("bitsandbytes' CPU 4-bit kernel needs AVX512-BF16")
    optimizer_step(policy, lr=0.5)  # a LoRA far from zero, so its part shows
    policy.model.eval()
    step = decode_step(merged, quantized_rows=2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40000, (2, 12), generator=gen)
    with torch.inference_mode():
        expected = policy.model(input_ids=ids).logits[:, -1].float()  # the trainer's (peft + bitsandbytes)
    got = {}
    for rows in (2, 0):  # NF4 + LoRA, then the dense merged weights
        step.quantized_rows = rows
        cache, _ = prefilled(merged.model(), ids[:, :-1], torch.ones(2, 11, dtype=torch.long))
        got[rows] = step(ids[:, -1], torch.full((2,), 11), torch.ones(2, 12, dtype=torch.long), cache)
    assert step._nf4 is not None and step._nf4[0][0].lora is not None
    scale = expected.abs().max()
    for logits in got.values():
        assert (logits - expected).abs().max() < 0.05 * scale  # bf16 rounding: ~2 % of the largest logit seen
    assert (got[2] - got[0]).abs().max() > 0  # the two paths did run differently
