"""The policy: a (4-bit) base model wrapped in a trainable LoRA adapter, on its device.

The base weights (``agl.policy.weights``) are quantized by bitsandbytes (``nf4`` by default) and
wrapped in a peft LoRA (``agl.policy.lora``). Disabling the adapter gives the reference policy for
KL without a second copy of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from agl.config import ModelConfig, typed
from agl.errors import ConfigError, disk_full_named
from agl.policy.device import resolve_device
from agl.policy.lora import (
    check_vocabulary_tie,
    find_adapter_dir,
    fold_tied_gradients,
    lora_config,
    resolve_train_merged,
    tied_lora_aliases,
    train_in_fp32,
)
from agl.policy.quiet import quiet_loading
from agl.policy.weights import resolve_model_path

QUANTIZATIONS = ("nf4", "fp4", "int8", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    train_merged: bool = (
        False  # the update runs LoRA linears merged (model.lora.train_merged, agl/train/merged_lora.py)
    )
    source: str = ""  # where the base weights were loaded from (a local dir or a hub id): the eval cache's key
    # an update or SFT step may dequantize each 4-bit weight once and keep it for the step (agl/train/merged_lora.py's
    # dequantized_4bit_layers): on a CPU, where bitsandbytes' dequantize is a large share of a pass; a GPU keeps
    # 4-bit's memory saving (its dequantize is a fast kernel). ``keeps_dequantized`` says whether a step does
    dequantize_once: bool = False

    def render_chat(
        self, messages: Sequence[dict], tools: Sequence[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
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
    def keeps_dequantized(self) -> bool:
        """Whether an update or SFT step keeps each 4-bit weight dequantized for the step: ``dequantize_once``, and
        not where the LoRA layers run merged (they keep their own merged weight; only a reference pass, the adapter
        off, would fill a second dense copy)."""
        return self.dequantize_once and not self.train_merged

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
        with disk_full_named(directory):
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


def resolve_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 where the hardware computes it natively (CUDA with bf16, or a CPU with
    AVX512-BF16/AMX, where a bf16 forward+backward is faster than fp32; measured:
    docs/benchmarks-history.md#compute-dtype), else fp32."""
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
        raise ConfigError(
            f"model.quantization '{quantization}' is not valid; choose one of: {', '.join(QUANTIZATIONS)}"
        )
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
    path = resolve_model_path(cfg.path, cfg.cache_dir, cfg.tiny, cfg.tokenizer)

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
        train_merged=resolve_train_merged(cfg.lora.train_merged, compute_dtype),
        source=str(path),
        dequantize_once=torch_device.type == "cpu",
    )


def own_checkpoint_tensors(model: torch.nn.Module) -> None:
    """Copy the tensors that still point into the mmapped checkpoint into memory of their own.

    ``from_pretrained`` maps safetensors files, and a weight it keeps in the file's dtype (the fp32
    embeddings and norms next to 4-bit layers) stays a view of the mapping, so the whole file's
    touched pages stay resident for the model's life. Safetensors hands such views out with
    non-resizable storages; torch's own allocations are resizable. Measured:
    docs/benchmarks-history.md#checkpoint-tensors-copied.
    """
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # a tied weight once
    for tensor in tensors.values():
        if tensor.device.type == "cpu" and not tensor.untyped_storage().resizable():
            tensor.data = tensor.data.clone()
