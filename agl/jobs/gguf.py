"""A llama-architecture HF model dir -> one GGUF file, for llama.cpp-family runtimes, with the ``gguf`` package.

    check_gguf_support(hf_dir)                         # first: a ConfigError if not mappable
    write_gguf(hf_dir, "model-bfloat16.gguf", "SmolLM2-135M-Instruct", torch.bfloat16)

What llama.cpp's ``convert_hf_to_gguf.py`` does for ``LlamaForCausalLM``, for the models agl
trains (SmolLM2, the tiny test model):
  - tensors renamed by ``gguf``'s own table (``gguf.get_tensor_name_map``):
    ``model.layers.N.self_attn.q_proj.weight`` -> ``blk.N.attn_q.weight``, ``model.norm.weight``
    -> ``output_norm.weight``, ... The rows of ``q_proj`` and ``k_proj`` are permuted from HF's
    rotate-half RoPE layout to llama.cpp's interleaved one (GGUF readers, transformers included,
    undo it). Tied embeddings write no ``output.weight``: llama.cpp then reuses ``token_embd``.
  - matrices in the dir's dtype (F32, F16 or BF16); norms always F32, as llama.cpp keeps them.
  - metadata: the hyperparameters llama.cpp reads (``llama.*``), the byte-level BPE vocabulary
    (tokens, token types, merges), the special token ids, whether to add BOS, the chat template.

Refused with a ConfigError naming what is unsupported, before the file is begun: another
architecture, RoPE scaling, attention or MLP biases, a tokenizer that is not byte-level BPE, or a
pre-tokenizer other than GPT-2's. ``tokenizer.ggml.pre`` tells llama.cpp how to split text before
BPE, and convert_hf_to_gguf finds it by hashing a probe text against a table of known tokenizers;
agl's tokenizer (transformers' conversion of the embedded GGUF's) splits exactly as GPT-2 does,
which is ``gpt-2`` there. Other splitters would need that table, so they are left out.
Also left out: quantized GGUF types (Q8_0, Q4_K, ...): llama.cpp's ``llama-quantize`` makes
them from this file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from agl.errors import ConfigError

GGUF_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}
GPT2_PRE = "gpt-2"  # llama.cpp's name for GPT-2's split regex (LLAMA_VOCAB_PRE_TYPE_GPT2)
# GGUFWriter logs its endianness and each file it writes at INFO: not actionable.
logging.getLogger("gguf").setLevel(logging.WARNING)


def check_gguf_support(hf_dir: Path) -> None:
    """Raise a ConfigError unless ``hf_dir`` (config.json, tokenizer.json) is one this module maps."""
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    model, pre = tokenizer.get("model", {}), tokenizer.get("pre_tokenizer") or {}
    gpt2_split = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
    if config.get("model_type") != "llama":
        problem = f"only the llama architecture is mapped, not {config.get('model_type')!r}"
    elif rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        problem = f"RoPE scaling ({rope.get('rope_type') or config.get('rope_scaling')}) is not mapped"
    elif config.get("attention_bias") or config.get("mlp_bias"):
        problem = "attention and MLP biases are not mapped"
    elif model.get("type") != "BPE" or not gpt2_split:
        problem = (
            "only byte-level BPE tokenizers that split text as GPT-2 does are mapped; this one is "
            f"{model.get('type')} with pre-tokenizer {json.dumps(pre)}"
        )
    else:
        return
    raise ConfigError(f"GGUF export: {problem} (algo.gguf=false exports the HF dir alone)")


def write_gguf(hf_dir: Path, path: Path, name: str, dtype: torch.dtype) -> None:
    """Write ``hf_dir`` (checked by ``check_gguf_support``, its weights in ``dtype``) as one GGUF file."""
    import gguf
    from safetensors import safe_open

    config = json.loads((hf_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as tensors:
            for key in tensors.keys():
                target = names.get_name(key, try_suffixes=(".weight", ".bias"))
                if target is None:
                    raise ConfigError(
                        f"GGUF export: tensor {key!r} has no llama.cpp name (algo.gguf=false exports the HF dir alone)"
                    )
                tensor = tensors.get_tensor(key)
                if key.endswith("q_proj.weight"):
                    tensor = interleave_rope_rows(tensor, heads)
                elif key.endswith("k_proj.weight"):
                    tensor = interleave_rope_rows(tensor, kv_heads)
                qtype = gguf.GGMLQuantizationType["F32" if tensor.ndim == 1 else GGUF_TYPES[dtype]]
                writer.add_tensor(target, gguf.quants.quantize(tensor.float().numpy(), qtype), raw_dtype=qtype)
    add_hyperparameters(writer, config, name, gguf.LlamaFileType[FILE_TYPES[GGUF_TYPES[dtype]]])
    add_vocabulary(writer, hf_dir, config["vocab_size"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q/k projection rows (per head: first halves, then second halves of the rotary pairs)
    in llama.cpp's order (pairs adjacent); ``LlamaModel.permute`` in convert_hf_to_gguf."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def add_hyperparameters(writer: Any, config: dict, name: str, file_type: Any) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)


def add_vocabulary(writer: Any, hf_dir: Path, vocab_size: int) -> None:
    """Tokens in id order (ids the tokenizer lacks are ``[PAD<id>]``, unused), their types (added
    special tokens CONTROL, other added ones USER_DEFINED), merges, special ids and the chat
    template (``gguf.SpecialVocab``), and whether the tokenizer adds a BOS token itself."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(by_id[i])
            types.append(
                gguf.TokenType.NORMAL
                if i not in added
                else gguf.TokenType.CONTROL
                if added[i].special
                else gguf.TokenType.USER_DEFINED
            )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(GPT2_PRE)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=vocab_size)
    probe = tokenizer("a")["input_ids"]
    special.add_special_token.setdefault("bos", bool(probe) and probe[0] == tokenizer.bos_token_id)
    special.add_to_gguf(writer, quiet=True)
