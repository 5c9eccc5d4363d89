"""``algo=export``: the trained policy as files that other runtimes load without agl.

    python harness.py algo=export model.adapter=<run dir> [algo.dtype=bfloat16] [algo.out=<dir>]

writes, into ``algo.out`` (default: ``export/`` in this job's run dir), built in a temporary dir
beside it and renamed into place when complete, so there is never a half-written export:
  - ``hf/``: a Hugging Face model dir (safetensors, config, generation config, tokenizer and
    chat template) that plain ``transformers.AutoModelForCausalLM.from_pretrained`` loads;
  - ``model-<dtype>.gguf``: the same weights as one GGUF file for llama.cpp-family runtimes
    (``agl.jobs.gguf``: llama architecture only; ``algo.gguf=false`` leaves it out).

Which base the LoRA is merged into: the full-precision base weights in the model dir, not the
NF4-quantized copy the policy trained on. For ``model.path=embedded`` that is the fp32 safetensors
copy agl dequantized from the package's Q4_1 GGUF (``agl.policy.weights.convert_embedded``); for ``tiny``
or a local HF dir, its weights as stored. peft merges the LoRA into them in float32
(``merge_and_unload``), and the result is cast to ``algo.dtype``.

The consequence for logits: the training policy computes ``nf4(W) x + B A x``, the export
``W x + B A x``. They differ by the base's NF4 rounding error, which the export does not have
and the LoRA never saw, plus the rounding of ``algo.dtype``. The export is the LoRA on the better
base, not the policy you evaluated (how far the export's logits are from the policy's, quantized and
not: docs/benchmarks-history.md#export-logits).
``algo=eval model.quantization=none model.adapter=<run dir>`` scores what the export computes;
the policy's own eval scores need not carry over.

Left out: merging into the dequantized NF4 weights instead (logits exactly the policy's, with
the 4-bit rounding baked into a full-precision file), and exporting without an adapter (the base
model dir is that export already).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agl.config import Config, ExportConfig
from agl.errors import ConfigError
from agl.jobs.gguf import check_gguf_support, write_gguf
from agl.policy.load import DTYPES
from agl.policy.lora import find_adapter_dir
from agl.policy.quiet import quiet_loading
from agl.policy.weights import resolve_model_path


def run_export(config: Config, run_dir: Path) -> dict:
    settings = config.model
    algo: ExportConfig = config.algo
    if not settings.adapter:
        raise ConfigError("algo=export needs model.adapter=<run dir or adapter dir>: the LoRA to merge")
    adapter_dir = find_adapter_dir(settings.adapter)
    if algo.dtype not in DTYPES:
        raise ConfigError(f"algo.dtype '{algo.dtype}' is not one of: {', '.join(DTYPES)}")
    dtype = DTYPES[algo.dtype]
    out = Path(algo.out).expanduser() if algo.out else run_dir / "export"
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"algo.out '{out}' already holds files; remove it or choose another algo.out")
    base = resolve_model_path(settings.path, settings.cache_dir, settings.tiny, settings.tokenizer)
    gguf_name = f"model-{algo.dtype}.gguf"
    with staged(out) as tmp:
        with quiet_loading():
            model, tokenizer = merged_model(base, adapter_dir, dtype)
            model.save_pretrained(tmp / "hf", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "hf")
        del model  # the GGUF is written from the saved dir
        if algo.gguf:
            check_gguf_support(tmp / "hf")
            write_gguf(tmp / "hf", tmp / gguf_name, settings.name, dtype)
    result = {
        "hf": str(out / "hf"),
        "gguf": str(out / gguf_name) if algo.gguf else None,
        "dtype": algo.dtype,
        "adapter": str(adapter_dir),
        "base": str(base),
    }
    print(f"merged {adapter_dir} into {base} ({algo.dtype}):")
    print(f"  transformers: AutoModelForCausalLM.from_pretrained('{result['hf']}')")
    if result["gguf"]:
        print(f"  llama.cpp:    llama-cli -m {result['gguf']}")
    return result


def merged_model(base: str, adapter_dir: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """The base in float32 with the adapter merged in by peft, cast to ``dtype``; and its tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapter_dir))
    merge_tied_lora_once(model)
    with warnings.catch_warnings():  # peft warns of a LoRA on tied embeddings; merge_tied_lora_once took care of it
        warnings.filterwarnings("ignore", message=r"Model with `tie_word_embeddings=True`", category=UserWarning)
        merged = model.merge_and_unload()
    return merged.to(dtype), AutoTokenizer.from_pretrained(base)


def merge_tied_lora_once(model: torch.nn.Module) -> None:
    """With tied embeddings, agl's LoRA on the vocabulary matrix (``model.lora.train_embeddings`` or
    ``train_head``, see ``agl.policy.lora.lora_config``) is one LoRA seen by both roles, the input
    embeddings and the output layer. peft would merge it into that one shared matrix twice, once
    per role; the output layer's LoRA is dropped here so it is merged once, through the embeddings."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    if isinstance(head, BaseTunerLayer) and isinstance(embed, BaseTunerLayer):
        if head.get_base_layer().weight is embed.get_base_layer().weight:
            base.set_output_embeddings(head.get_base_layer())


@contextlib.contextmanager
def staged(target: Path) -> Iterator[Path]:
    """A temporary dir beside ``target``, renamed to ``target`` if the block succeeds, else deleted."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}")
    tmp.mkdir()  # not mkdtemp: its 0700 would stay on the export; mkdir honours the umask
    try:
        yield tmp
        if target.exists():
            target.rmdir()  # empty: run_export refuses a target that holds files
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(config: Config, run_dir: Path) -> object:
    """``algo=export``: what ``agl.jobs.dispatch`` calls."""
    return run_export(config, run_dir)
