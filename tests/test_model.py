"""The policy (agl/policy/weights.py, load.py, lora.py): conversion cache, the 4-bit + LoRA model, loading variants.

Three parts:
  1. the conversion cache: reuse, rebuild after damage, atomicity when a build is interrupted
     (a writer that raises, a process SIGKILLed mid-write). The machinery is exercised with the
     tiny model's files (fast); the real GGUF -> safetensors conversion runs once, into a tmp dir.
  2. the embedded SmolLM2-135M-Instruct, NF4 + LoRA r16 on all linear layers, loaded once per
     module from the default cache (~/.cache/agl, or $AGL_CACHE).
  3. loading variants: an existing adapter (dir or run dir), quantization none / fp4 / int8.

Tests marked `slow` use the real embedded model; they run by default (`-m "not slow"` skips).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import agl.policy.weights as agl_weights
from agl.errors import ConfigError
from agl.policy.load import load_policy
from agl.policy.lora import find_adapter_dir
from agl.policy.weights import (
    EMBEDDED_GGUF,
    MANIFEST,
    cache_is_complete,
    cached_model_dir,
    convert_embedded,
    file_sha256,
    find_embedded_gguf,
    resolve_model_path,
    write_cache_atomically,
)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
LORA_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a small shared CPU box, torch's OpenMP threads spin against other
    processes and make the 4-bit CPU path several times slower (a 36-token forward: 0.3 s with one
    thread, up to 8 s with two under load). Nothing here depends on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ============================================================================ 1. conversion cache


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_cfg) -> Path:
    """A real, complete HF model dir (the tiny model in the default cache): source for writers."""
    return Path(resolve_model_path(tiny_model_cfg.path, tiny_model_cfg.cache_dir, tiny_model_cfg.tiny))


class CopyWriter:
    """A cache writer producing the tiny model's files in the temp dir; counts its calls."""

    def __init__(self, source: Path):
        self.source = source
        self.calls = 0

    def __call__(self, tmp: Path) -> None:
        self.calls += 1
        for f in sorted(self.source.iterdir()):
            if f.is_file() and f.name != MANIFEST:
                shutil.copy(f, tmp / f.name)


def load_state(directory: Path) -> dict[str, torch.Tensor]:
    """Load the model in ``directory`` the way the product does (from_pretrained) -> state dict."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def identity(path: Path) -> tuple:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def entries(cache: Path) -> list[str]:
    """What a cache dir holds besides ``.locks/`` (its builders' lock files)."""
    return sorted(p.name for p in cache.iterdir() if p.name != ".locks")


def leftovers(cache: Path, key: str) -> list[Path]:
    """Temporary build dirs of ``key`` (``.<key>.<random>``) left in ``cache``."""
    return sorted(p for p in cache.iterdir() if p.name.startswith(f".{key}."))


def test_cache_is_built_once_then_reused(tmp_path, tiny_dir):
    writer = CopyWriter(tiny_dir)
    target = cached_model_dir(tmp_path, "m", writer)

    assert target == tmp_path / "m" and writer.calls == 1
    assert cache_is_complete(target)
    manifest = json.loads((target / MANIFEST).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= manifest.keys()
    weights = target / "model.safetensors"
    assert manifest["model.safetensors"] == {"size": weights.stat().st_size, "sha256": file_sha256(weights)}
    assert entries(tmp_path) == ["m"]  # no temp dir left behind
    before = identity(target), identity(weights)

    assert cached_model_dir(tmp_path, "m", writer) == target
    assert writer.calls == 1  # not rebuilt
    assert (identity(target), identity(weights)) == before
    assert_same_state(load_state(target), load_state(tiny_dir))


class SlowWriter(CopyWriter):
    """A CopyWriter that takes its time, so that builders started together overlap."""

    def __call__(self, tmp: Path) -> None:
        time.sleep(0.5)
        super().__call__(tmp)


def test_builders_of_one_missing_entry_at_once_build_it_once(tmp_path, tiny_dir):
    """The jobs of a sweep (or test lanes) on a fresh cache: one builds, the others wait for it and reuse it."""
    writer = SlowWriter(tiny_dir)
    targets = []
    builders = [
        threading.Thread(target=lambda: targets.append(cached_model_dir(tmp_path, "m", writer))) for _ in range(3)
    ]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert targets == [tmp_path / "m"] * 3 and writer.calls == 1 and cache_is_complete(tmp_path / "m")


def test_building_the_cache_leaves_the_random_state_as_it_was(tmp_path):
    """A run that builds a cache entry (its writer seeds torch and draws random weights) must
    compute what a run that finds it computes: the LoRA's initial weights come next from that state."""

    def seeding_writer(tmp: Path) -> None:
        torch.manual_seed(0)
        (tmp / "w.bin").write_bytes(torch.rand(8).numpy().tobytes())

    torch.manual_seed(3)
    cached_model_dir(tmp_path, "m", seeding_writer)  # built
    built = torch.rand(4)
    torch.manual_seed(3)
    cached_model_dir(tmp_path, "m", seeding_writer)  # found
    assert torch.equal(torch.rand(4), built)


def truncate(d: Path) -> None:
    f = d / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)


def flip_middle_byte(d: Path) -> None:
    """Same size, one byte different: only the checksum can tell."""
    f = d / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


def delete_manifest(d: Path) -> None:
    (d / MANIFEST).unlink()


def delete_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def garble_manifest(d: Path) -> None:
    (d / MANIFEST).write_text('{"files": ')


@pytest.mark.parametrize("damage", [truncate, flip_middle_byte, delete_manifest, delete_weights, garble_manifest])
def test_damaged_cache_is_rebuilt_and_loads(tmp_path, tiny_dir, damage):
    writer = CopyWriter(tiny_dir)
    target = cached_model_dir(tmp_path, "m", writer)
    damage(target)
    assert not cache_is_complete(target)

    assert cached_model_dir(tmp_path, "m", writer) == target
    assert writer.calls == 2
    assert cache_is_complete(target)
    assert entries(tmp_path) == ["m"]
    assert_same_state(load_state(target), load_state(tiny_dir))


def test_writer_failing_midway_leaves_no_cache(tmp_path, tiny_dir):
    def failing(tmp: Path) -> None:
        data = (tiny_dir / "model.safetensors").read_bytes()
        shutil.copy(tiny_dir / "config.json", tmp / "config.json")
        (tmp / "model.safetensors").write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_cache_atomically(tmp_path / "m", failing)
    assert entries(tmp_path) == []  # neither a target nor a temp dir
    assert not cache_is_complete(tmp_path / "m")

    writer = CopyWriter(tiny_dir)
    target = cached_model_dir(tmp_path, "m", writer)
    assert writer.calls == 1 and cache_is_complete(target)
    assert_same_state(load_state(target), load_state(tiny_dir))


def test_concurrent_builder_keeps_the_cache_finished_first(tmp_path, tiny_dir):
    """Two builders that share no lock (on one machine they wait on ``.locks/<key>``; two hosts on a network
    filesystem, where flock may not lock across hosts, do not) both build; the one finishing second must not
    delete the complete cache the first already put in place (that process may be loading it)."""
    started, first_done, result = threading.Event(), threading.Event(), {}
    slow_writer = CopyWriter(tiny_dir)

    def slow(tmp: Path) -> None:
        started.set()
        slow_writer(tmp)
        assert first_done.wait(60)

    def build_slowly() -> None:
        try:
            result["path"] = write_cache_atomically(tmp_path / "m", slow)
        except BaseException as error:  # reported below, in the test's thread
            result["error"] = error

    thread = threading.Thread(target=build_slowly)
    thread.start()
    assert started.wait(60)
    fast_writer = CopyWriter(tiny_dir)
    target = write_cache_atomically(tmp_path / "m", fast_writer)
    first = identity(target), identity(target / "model.safetensors")
    first_done.set()
    thread.join(60)

    assert "error" not in result, result.get("error")
    assert result["path"] == target and slow_writer.calls == fast_writer.calls == 1
    assert (identity(target), identity(target / "model.safetensors")) == first  # kept, not replaced
    assert cache_is_complete(target) and entries(tmp_path) == ["m"]


def test_builder_losing_the_rename_race_accepts_the_winners_cache(tmp_path, tiny_dir, monkeypatch):
    """Another process renames its build into place between our check and our os.replace."""
    target, real_replace, raced = tmp_path / "m", os.replace, []
    winner = CopyWriter(tiny_dir)

    def racing_replace(src, dst):
        if not raced:
            raced.append(True)
            write_cache_atomically(target, winner)  # the other process wins, right now
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", racing_replace)
    loser = CopyWriter(tiny_dir)
    assert cached_model_dir(tmp_path, "m", loser) == target
    monkeypatch.undo()
    assert raced and winner.calls == loser.calls == 1
    assert cache_is_complete(target) and entries(tmp_path) == ["m"]
    assert_same_state(load_state(target), load_state(tiny_dir))


# Runs a cache build in a child process and parks it at `phase` so the test can SIGKILL it there:
#   mid-file:      half of model.safetensors written (and fsynced) into the temp dir;
#   before-rename: every file and the manifest written, just before os.replace moves the dir.
KILLED_BUILD = r"""
import os, shutil, sys, time
from pathlib import Path
import agl.policy.weights as m

cache, source, phase, ready = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])

def park():
    ready.write_text(str(os.getpid()))
    time.sleep(600)

def write(tmp):
    for f in sorted(source.iterdir()):
        if not f.is_file() or f.name == m.MANIFEST:
            continue
        if phase == "mid-file" and f.name == "model.safetensors":
            data = f.read_bytes()
            with open(tmp / f.name, "wb") as out:
                out.write(data[: len(data) // 2])
                out.flush()
                os.fsync(out.fileno())
                park()
        shutil.copy(f, tmp / f.name)

if phase == "before-rename":
    os.replace = lambda src, dst: park()
m.cached_model_dir(cache, "m", write)
raise SystemExit("the build was not parked")
"""


@pytest.mark.parametrize("phase", ["mid-file", "before-rename"])
def test_build_killed_mid_write_leaves_no_valid_cache(tmp_path, tiny_dir, phase):
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_BUILD, str(cache), str(tiny_dir), phase, str(ready)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None, f"build exited early: {child.communicate()[0]}"
            assert time.monotonic() < deadline, "build never reached the kill point"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    assert child.returncode == -signal.SIGKILL

    target = cache / "m"
    assert not target.exists() and not cache_is_complete(target)
    [leftover] = leftovers(cache, "m")
    if phase == "mid-file":
        assert not (leftover / MANIFEST).exists()
        assert (leftover / "model.safetensors").stat().st_size < (tiny_dir / "model.safetensors").stat().st_size
    else:  # the leftover even looks complete, but it is not at the target name: never used
        assert cache_is_complete(leftover)
    leftover_files = sorted((p.name, p.stat().st_size) for p in leftover.iterdir())

    writer = CopyWriter(tiny_dir)
    assert cached_model_dir(cache, "m", writer) == target
    assert writer.calls == 1 and cache_is_complete(target)
    assert_same_state(load_state(target), load_state(tiny_dir))
    # the leftover neither confused the build nor was touched by it; the cache is then reused
    assert leftovers(cache, "m") == [leftover]
    assert sorted((p.name, p.stat().st_size) for p in leftover.iterdir()) == leftover_files
    assert cached_model_dir(cache, "m", writer) == target and writer.calls == 1


# ---------------------------------------------------------------------------- the real conversion


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The real GGUF -> safetensors conversion, once, into a fresh cache dir."""
    return convert_embedded(tmp_path_factory.mktemp("agl-cache"))


@pytest.mark.slow
def test_real_conversion_is_complete_and_loadable(converted):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    gguf = find_embedded_gguf()
    assert gguf.name == EMBEDDED_GGUF
    assert converted.name == f"smollm2-135m-instruct-{file_sha256(gguf)[:16]}"
    assert cache_is_complete(converted)
    assert entries(converted.parent) == [converted.name]  # no temp dir left
    manifest = json.loads((converted / MANIFEST).read_text())["files"]
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= manifest.keys()

    config = AutoConfig.from_pretrained(converted)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert getattr(config, "quantization_config", None) is None  # a plain float model, not "GGUF-quantized"
    with safe_open(converted / "model.safetensors", "pt") as f:
        names = list(f.keys())
        assert len(names) == 272
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2 and tokenizer.chat_template

    # deterministic: byte-identical to the copy the default cache holds (when it has one)
    default = Path(os.environ.get("AGL_CACHE", "~/.cache/agl")).expanduser() / converted.name
    if cache_is_complete(default):
        assert json.loads((default / MANIFEST).read_text())["files"] == manifest


@pytest.mark.slow
def test_real_conversion_is_reused(converted, monkeypatch):
    weights = converted / "model.safetensors"
    before = identity(converted), identity(weights)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the complete cache was rebuilt")

    monkeypatch.setattr(agl_weights, "write_cache_atomically", no_rebuild)
    assert convert_embedded(converted.parent) == converted
    assert (identity(converted), identity(weights)) == before


@pytest.mark.slow
def test_real_conversion_damage_is_detected(converted):
    """Flipping one byte of the real 538 MB weights file fails the checksum (the rebuild itself is
    tested above with the tiny model's files, to spare another 15 s conversion)."""
    try:
        flip_middle_byte(converted)
        assert not cache_is_complete(converted)
    finally:
        flip_middle_byte(converted)  # flip it back
    assert cache_is_complete(converted)


# ============================================================================ 2. the 4-bit + LoRA model


@pytest.fixture(scope="module")
def model_cfg():
    """The real `model` config group (conf/model/smollm2.yaml, as composed by Hydra)."""
    from helpers import compose_cfg

    cfg = compose_cfg()
    return OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=True))


def variant(cfg, **changes):
    cfg = cfg.copy()
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.fixture(scope="module")
def policy(model_cfg):
    assert (model_cfg.path, model_cfg.quantization, model_cfg.lora.r) == ("embedded", "nf4", 16)
    return load_policy(model_cfg, "cpu")


def lora_params(policy) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in policy.model.named_parameters() if "lora_" in n}


@pytest.fixture
def restore_lora(policy):
    """Tests that change LoRA weights put them back, so the module's policy stays fresh."""
    saved = {n: p.detach().clone() for n, p in lora_params(policy).items()}
    yield
    with torch.no_grad():
        for n, p in lora_params(policy).items():
            p.copy_(saved[n])
    policy.model.zero_grad(set_to_none=True)
    policy.model.eval()


def prompt_ids(policy, messages=PROMPT) -> torch.Tensor:
    return torch.tensor([policy.render_chat(messages)])


def greedy(policy, max_new_tokens: int, messages=PROMPT) -> str:
    ids = prompt_ids(policy, messages)
    with torch.no_grad():
        out = policy.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=policy.eos_token_ids,
            pad_token_id=policy.tokenizer.pad_token_id,
        )
    return policy.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def logits(policy, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return policy.model(input_ids=ids).logits


def lm_loss(policy, text: str = "The capital of France is Paris. It lies on the Seine.") -> torch.Tensor:
    ids = torch.tensor([policy.tokenizer(text)["input_ids"]])
    return policy.model(input_ids=ids, labels=ids).loss


@pytest.mark.slow
def test_lora_wraps_4bit_base_layers(policy):
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    layers = {n: m for n, m in policy.model.named_modules() if isinstance(m, LoraLayer)}
    assert len(layers) == 30 * len(LORA_TARGETS)  # every linear layer of every block
    assert {n.rsplit(".", 1)[-1] for n in layers} == LORA_TARGETS
    for name, layer in layers.items():
        base = layer.base_layer
        assert isinstance(base, bnb.nn.Linear4bit), name
        assert base.weight.dtype == torch.uint8 and base.weight.quant_state.quant_type == "nf4", name
    # the (tied) embedding / lm_head are not adapted and not quantized
    assert not isinstance(policy.model.get_output_embeddings(), (LoraLayer, bnb.nn.Linear4bit))


def mapped_checkpoints() -> list[tuple[int, int]]:
    """Address ranges of the safetensors files this process has mapped."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(".safetensors"):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_the_loaded_policy_keeps_nothing_of_the_mapped_checkpoint(policy):
    """The fp32 embeddings and norms are copied out of the mmapped safetensors file, so the file
    is unmapped and its pages stop counting in the process's resident memory."""
    tensors = [*policy.model.parameters(), *policy.model.buffers()]
    assert policy.model.get_input_embeddings().weight.dtype == torch.float32
    mapped = mapped_checkpoints()
    assert not [t.shape for t in tensors if any(start <= t.data_ptr() < end for start, end in mapped)]
    assert all(t.untyped_storage().resizable() for t in tensors)
    assert policy.model.get_input_embeddings().weight is policy.model.get_output_embeddings().weight


@pytest.mark.slow
def test_only_lora_parameters_are_trainable(policy):
    named = dict(policy.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable == {n for n in named if "lora_" in n}
    assert len(trainable) == 2 * 30 * len(LORA_TARGETS)  # lora_A and lora_B per layer
    assert all(named[n].dtype == torch.float32 for n in trainable)
    assert [id(p) for p in policy.trainable_parameters()] == [id(named[n]) for n in named if n in trainable]


@pytest.mark.slow
def test_parameter_counts_of_default_lora(policy):
    config, r = policy.model.config, 16
    h, i, kv = (
        config.hidden_size,
        config.intermediate_size,
        config.num_key_value_heads * (config.hidden_size // config.num_attention_heads),
    )
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
    expected_lora = config.num_hidden_layers * sum(r * (n_in + n_out) for n_in, n_out in shapes)

    trainable, total = policy.parameter_counts()
    assert trainable == expected_lora == 4_884_480  # ~4.88M
    assert total == 139_399_488  # ~139M: the 134.5M base (4-bit weights counted unpacked) + LoRA
    assert total - trainable == 134_515_008


@pytest.mark.slow
def test_context_length_and_eos(policy):
    assert policy.context_length == 8192
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in policy.eos_token_ids
    assert policy.name == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_render_chat_round_trips_through_tokenizer(policy):
    messages = [{"role": "system", "content": "You are terse."}, *PROMPT]
    ids = policy.render_chat(messages)
    assert all(isinstance(i, int) for i in ids)
    text = policy.tokenizer.decode(ids)
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in text
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert policy.tokenizer(text, add_special_tokens=False)["input_ids"] == ids

    no_prompt = policy.tokenizer.decode(policy.render_chat(messages, add_generation_prompt=False))
    assert "<|im_start|>assistant" not in no_prompt


@pytest.mark.slow
def test_greedy_answer_is_fluent_english(policy):
    answer = greedy(policy, max_new_tokens=16)
    assert "Paris" in answer, answer
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in answer)
    assert letters >= 0.85 * len(answer), answer
    assert len(answer.split()) >= 5, answer


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, plus the 4-bit weights' raw bytes and quantization state."""
    import bitsandbytes as bnb

    state = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    state |= {f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.weight.quant_state
            state[f"bytes:{name}"] = module.weight.data.view(torch.uint8).clone()
            state[f"absmax:{name}"] = qs.absmax.clone()
            state[f"code:{name}"] = qs.code.clone()
    return state


@pytest.mark.slow
def test_one_optimizer_step_changes_only_lora(policy, restore_lora):
    before = snapshot(policy.model)
    # sample first, as the route does: generation must not repack the 4-bit weights (see
    # keep_4bit_matmul_differentiable) nor cut gradients through the base layers afterwards
    greedy(policy, max_new_tokens=2)

    policy.model.train()
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    loss = lm_loss(policy)
    assert torch.isfinite(loss)
    loss.backward()
    grads = {n: p.grad for n, p in lora_params(policy).items()}
    assert all(grads[n] is not None and grads[n].abs().sum() > 0 for n in grads if "lora_B" in n)
    optimizer.step()

    after = snapshot(policy.model)
    assert after.keys() == before.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the step changed nothing"
    assert all("lora_" in k for k in changed), sorted(k for k in changed if "lora_" not in k)[:5]
    assert {f"param:{n}" for n in lora_params(policy) if "lora_B" in n} <= changed
    # and it learned something: the loss on the same text went down
    with torch.no_grad():
        assert lm_loss(policy) < loss


@pytest.mark.slow
def test_reference_disables_the_adapter(policy, restore_lora):
    ids = prompt_ids(policy)
    assert all(torch.count_nonzero(p) == 0 for n, p in lora_params(policy).items() if "lora_B" in n)
    base = logits(policy, ids)  # lora_B == 0: the adapter adds nothing, this is the base model

    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in lora_params(policy).items():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    adapted = logits(policy, ids)
    assert (adapted - base).abs().max() > 0.1

    with policy.reference():
        reference = logits(policy, ids)
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(policy, ids), adapted, rtol=0, atol=1e-5)  # back on afterwards


# ============================================================================ 3. loading variants


@pytest.mark.slow
def test_load_existing_adapter(policy, model_cfg, tmp_path, restore_lora):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in lora_params(policy).values():
            p.add_(torch.randn_like(p) * 0.02)
    saved = {n: p.detach().clone() for n, p in lora_params(policy).items()}
    ids = prompt_ids(policy)
    expected = logits(policy, ids)
    adapter_dir = tmp_path / "run" / "adapter"
    policy.save_adapter(adapter_dir)
    assert (adapter_dir / "adapter_config.json").is_file() and (adapter_dir / "adapter_model.safetensors").is_file()

    loaded = load_policy(variant(model_cfg, adapter=str(adapter_dir)), "cpu")
    got = lora_params(loaded)
    assert got.keys() == saved.keys()
    for n in saved:
        assert torch.equal(got[n].detach(), saved[n]), n
        assert got[n].requires_grad and got[n].dtype == torch.float32, n  # trainable: training continues
    assert loaded.parameter_counts() == policy.parameter_counts()
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=1e-5)

    # a run dir holding adapter/ is accepted too
    assert find_adapter_dir(str(tmp_path / "run")) == adapter_dir
    assert find_adapter_dir(str(adapter_dir)) == adapter_dir


def test_load_adapter_from_run_dir(tiny_model_cfg, tmp_path):
    """`model.adapter=<run dir>` (one holding adapter/), end to end, on the tiny model."""
    first = load_policy(tiny_model_cfg, "cpu")
    torch.manual_seed(2)
    with torch.no_grad():
        for p in lora_params(first).values():
            p.add_(torch.randn_like(p))
    first.save_adapter(tmp_path / "adapter")

    again = load_policy(variant(tiny_model_cfg, adapter=str(tmp_path)), "cpu")
    for n, p in lora_params(first).items():
        assert torch.equal(lora_params(again)[n].detach(), p.detach()), n


def test_adapter_dir_without_adapter_is_a_config_error(tiny_model_cfg, tmp_path):
    with pytest.raises(ConfigError, match="holds no adapter_config.json") as error:
        load_policy(variant(tiny_model_cfg, adapter=str(tmp_path)), "cpu")
    assert str(tmp_path) in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "fp4", "int8"])
def test_quantization_variants_load_and_train(model_cfg, quantization):
    """Each quantization loads, answers the fixed prompt, and passes gradients to the LoRA."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    variant_policy = load_policy(variant(model_cfg, quantization=quantization), "cpu")
    expected = {"none": torch.nn.Linear, "fp4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}[quantization]
    bases = [m.base_layer for m in variant_policy.model.modules() if isinstance(m, LoraLayer)]
    assert len(bases) == 210 and all(type(b) is expected for b in bases)
    if quantization == "fp4":
        assert all(b.weight.quant_state.quant_type == "fp4" for b in bases)
    assert variant_policy.parameter_counts() == (4_884_480, 139_399_488)

    assert "Paris" in greedy(variant_policy, max_new_tokens=7)
    variant_policy.model.train()
    lm_loss(variant_policy).backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in lora_params(variant_policy).items() if "lora_B" in n
    )
