"""The CUDA lane's own checks (docs/gpu.md), beside the tests that take ``device`` (tests/conftest.py):

- the 4-bit base layers run bitsandbytes' CUDA kernels, not a CPU fallback;
- the sampler's and the trainer's log-probs agree in bf16 (``logprob_diff_abs`` <= 0.03);
- an exact run on CUDA asks for deterministic kernels (tests/test_reproducible.py then runs on cuda too);
- a decode step and an update keep their work on the device: only inputs and per-token values cross;
- the GPU's peak memory goes into the metrics (``peak_vram_mib``);
- a run on CUDA leaves the CPU-only memory measures off (agl/memory.py).

Each runs on the CPU as well where that means something; the cuda runs skip without a GPU.
"""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device_checks import crossings
from helpers import eval_policy

from agl.config import GRPOConfig
from agl.memory import runs_on_cuda
from agl.policy.decode import decode_step
from agl.policy.device import deterministic_kernels, device_memory
from agl.policy.engine import Engine, SamplingParams
from agl.policy.load import load_policy
from agl.policy.sampler_weights import MergedSampler
from agl.train.grpo import GRPOUpdate
from agl.train.samples import Sample

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ("Hi", "What is 2 + 2? Think step by step.", "Name a colour", "Write a long sentence about the sea.")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


def sampled(policy, n=4, max_tokens=16) -> list[Sample]:
    """``n`` sampled continuations (temperature 1) of each of TEXTS through the engine, as training samples."""
    prompts = [policy.render_chat([{"role": "user", "content": text}]) for text in TEXTS]

    async def run():
        engine = Engine(policy)
        await engine.start()
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True)
            groups = [engine.submit(p, params, n=n) for p in prompts]
            await asyncio.gather(*(s.wait() for seqs in groups for s in seqs))
        finally:
            await engine.stop()
        return groups

    return [
        Sample(
            rollout_id=f"{g}-{i}",
            prompt_ids=list(seq.prompt_ids),
            completion_ids=list(seq.token_ids),
            mask=[1] * len(seq.token_ids),
            logprobs=list(seq.logprobs),
            reward=float(i % 2),
            truncated=False,
            temperature=1.0,
            group=str(g),
        )
        for g, seqs in enumerate(asyncio.run(run()))
        for i, seq in enumerate(seqs)
    ]


# ----------------------------------------------------------------------------- bitsandbytes on the GPU


@pytest.mark.cuda
@needs_cuda
def test_the_4bit_base_layers_run_bitsandbytes_cuda_kernels(tiny_model_cfg):
    from bitsandbytes.nn import Linear4bit

    policy = load_policy(tiny_model_cfg, "cuda")
    layers = [m for m in policy.model.modules() if isinstance(m, Linear4bit)]
    assert layers and all(m.weight.device.type == "cuda" and m.weight.quant_state is not None for m in layers)
    ids = torch.tensor([policy.render_chat([{"role": "user", "content": "Hi"}])], device="cuda")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        policy.model(input_ids=ids).logits[0, -1].logsumexp(-1).backward()  # the sampler's forward, the update's
        torch.cuda.synchronize()
    kernels = {e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    bnb = [k for k in kernels if "dequantize" in k.lower() or "4bit" in k.lower()]
    assert bnb, f"no bitsandbytes kernel among: {sorted(kernels)[:40]}"


# ----------------------------------------------------------------------------- numerics


def test_the_samplers_and_the_trainers_logprobs_agree_in_bf16(tiny_model_cfg, device):
    """The route records the merged bf16 sampler's log-probs; the update recomputes them through the NF4 + LoRA
    model in bf16: their mean gap per token is the update's ``logprob_diff_abs``."""
    cfg = tiny_model_cfg.copy()
    cfg.compute_dtype = "bfloat16"
    policy = eval_policy(cfg, device)
    with torch.no_grad():  # logits spread like a trained model's (entropy ~3 nats at T=1 here), not near-uniform
        policy.model.get_input_embeddings().weight.mul_(10)  # tied: the output layer too
    samples = sampled(policy)
    update = GRPOUpdate(policy, GRPOConfig(lr=0.0, loss={"type": "grpo"}, micro_batch_size=4, old_logprobs="recorded"))
    metrics = update.step(samples, [0.5, -0.5] * (len(samples) // 2))
    assert metrics["train_tokens"] == sum(len(s.completion_ids) for s in samples)
    assert 0 < metrics["logprob_diff_abs"] <= 0.03, metrics["logprob_diff_abs"]
    assert 1 < metrics["entropy"] < 6  # a sampled distribution, neither near-uniform nor one token


def test_an_exact_run_asks_for_deterministic_kernels_on_cuda_only(device):
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(device) as turned_on:
        assert turned_on == (device == "cuda")
        assert torch.are_deterministic_algorithms_enabled() == (device == "cuda")
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: see the next test
    assert not torch.are_deterministic_algorithms_enabled()  # process-wide: given back


@needs_cuda
@pytest.mark.cuda
def test_attention_backward_repeats_bitwise_in_an_exact_run():
    """On an H200 (2026-11-27) one seed gave two adapters: with ``warn_only=True`` the memory-efficient
    attention backward warned and split its keys across blocks, summing them in whatever order they finished.
    Strict mode makes torch run it unsplit. A shape that splits: long keys, few batch x heads."""
    q, k, v = (torch.randn(1, 2, 1024, 64, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 2, 1024, 64, device="cuda")

    def grads():
        for t in (q, k, v):
            t.grad = None
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        return [t.grad.clone() for t in (q, k, v)]

    with deterministic_kernels("cuda"):
        first = grads()
        assert all(torch.equal(a, b) for _ in range(5) for a, b in zip(first, grads()))


# ----------------------------------------------------------------------------- where the work happens


def test_the_crossing_detector_sees_a_copy_and_an_op_across_devices():
    """What the checks below rely on, shown with the meta device (no GPU needed): a copy and an op mixing
    devices are seen, with their sizes; a CPU scalar in another device's op is not a crossing."""
    on_meta = torch.ones(3, 4, device="meta")
    with crossings() as found:
        moved = torch.ones(3, 4).to("meta")
        on_meta.index_select(0, torch.tensor([0, 2]))
        on_meta * torch.tensor(2.0)
        on_meta + moved
    assert [(c.op, c.devices, c.numel) for c in found] == [
        ("aten._to_copy.default", ("cpu", "meta"), 12),
        ("aten.index_select.default", ("cpu", "meta"), 12),
    ]


def test_a_decode_step_and_an_update_keep_their_work_on_the_device(tiny_model_cfg, device):
    """Inside a decode step only its inputs go to the device and the sampled rows' logits come back; inside an
    update only token ids, masks and per-token values cross (the loss is summed on the CPU), never a weight, an
    activation or a vocabulary-wide row."""
    policy = eval_policy(tiny_model_cfg, device)
    samples = sampled(policy, n=2, max_tokens=8)
    # a decode step: 3 rows of 9 cached positions
    merged = MergedSampler(policy.model, policy.compute_dtype)
    step = decode_step(merged)
    ids = torch.tensor([s.prompt_ids[-9:] for s in samples[:3]])
    mask = torch.ones_like(ids)
    from test_decode import prefilled

    cache, tokens = prefilled(merged.model(), ids, mask)
    tokens = tokens.cpu()
    mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    with crossings() as found:
        logits = step(tokens, mask.sum(-1) - 1, mask, cache)
    vocabulary = logits.shape[-1]
    wide = [c for c in found if c.numel > mask.numel()]
    assert [c.numel for c in wide] == ([3 * vocabulary] if device != "cpu" else []), found
    # an update
    update = GRPOUpdate(policy, GRPOConfig(lr=1e-3, loss={"type": "grpo"}, micro_batch_size=4))
    tokens_in_batch = len(samples) * max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    with crossings() as found:
        update.step(samples, [1.0, -1.0] * (len(samples) // 2))
    assert all(c.numel <= tokens_in_batch for c in found), sorted(found, key=lambda c: -c.numel)[:5]
    assert bool(found) == (device != "cpu")


# ----------------------------------------------------------------------------- memory


def test_the_peak_gpu_memory_is_reported_on_cuda_only(device):
    if device == "cpu":
        assert device_memory("cpu") == {}
        return
    block = torch.empty(16 << 20, dtype=torch.uint8, device=device)  # 16 MiB
    assert device_memory(device)["peak_vram_mib"] >= 16
    del block


def test_runs_on_cuda_reads_the_command_line_then_the_machine(tmp_path):
    assert runs_on_cuda(["device=cuda"], {}, tmp_path) and runs_on_cuda(["+device=cuda:0"], {}, tmp_path)
    assert not runs_on_cuda(["device=cpu"], {}, tmp_path)
    assert not runs_on_cuda(["model=tiny"], {}, tmp_path)  # auto, and no NVIDIA device here
    (tmp_path / "nvidiactl").touch()
    assert not runs_on_cuda([], {}, tmp_path)  # the driver's control node is no GPU
    (tmp_path / "nvidia0").touch()
    assert runs_on_cuda([], {}, tmp_path) and runs_on_cuda(["device=auto"], {}, tmp_path)
    assert not runs_on_cuda([], {"CUDA_VISIBLE_DEVICES": ""}, tmp_path)
    assert not runs_on_cuda(["device=cpu"], {}, tmp_path)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_run_on_cuda_leaves_the_cpu_memory_measures_off(device, tmp_path):
    """With a malloc asked for that does not exist: a CPU run stops on it first thing (agl/memory.py); a CUDA run
    never looks (on a machine without a GPU it then stops at the device instead)."""
    env = {**os.environ, "AGL_ALLOCATOR": "tcmalloc2", "AGL_CACHE": os.environ.get("AGL_CACHE", "~/.cache/agl")}
    out = subprocess.run(
        [sys.executable, "harness.py", "model=tiny", "algo=info", f"device={device}", f"hydra.run.dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    if device == "cpu":
        assert out.returncode == 2 and "AGL_ALLOCATOR=tcmalloc2" in out.stderr
    elif torch.cuda.is_available():
        assert out.returncode == 0, out.stderr[-2000:]
        assert "malloc: glibc" in out.stdout and "device: cuda" in out.stdout
    else:
        assert out.returncode == 2, out.stderr[-2000:]
        assert out.stderr.strip() == "error: device 'cuda' was asked for, but torch sees no CUDA device"
