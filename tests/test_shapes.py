"""Random-weight models built from a tokenizer folder alone, and the real models' shapes (conf/model/shape_*.yaml).

What a GPU node is sent holds no embedded GGUF: ``model.tokenizer=<dir>`` (bench/export_tokenizer.py) must build
the same tiny model the GGUF's tokenizer builds, and the shapes must be the real models' with its vocabulary.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import agl.policy.weights
from agl.config import ModelConfig, compose_checked, plain, typed
from agl.errors import ConfigError
from agl.policy.weights import build_tiny, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
VOCABULARY = 49152  # the embedded tokenizer's
# parameters outside the vocabulary matrices, as the models' cards give them
NON_EMBEDDING = {"shape_smollm2_135m": 106.2e6, "shape_qwen25_05b": 0.36e9, "shape_qwen25_15b": 1.31e9}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tiny_model_cfg) -> Path:
    """The embedded tokenizer's files, as bench/export_tokenizer.py writes them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_tokenizer", ROOT / "bench" / "export_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("tokenizer")
    files = module.export(out, tiny_model_cfg.cache_dir)
    assert {p.name for p in files} >= {"tokenizer.json", "tokenizer_config.json"}
    assert sum(p.stat().st_size for p in files) < 8 * 2**20  # what travels to a GPU node
    return out


def test_a_tiny_model_builds_from_a_tokenizer_folder_without_the_gguf(tiny_model_cfg, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    def no_gguf(*args, **kwargs):
        raise AssertionError("the embedded GGUF was read")

    from_gguf = Path(resolve_model_path("tiny", tiny_model_cfg.cache_dir, dict(tiny_model_cfg.tiny)))
    saved = agl.policy.weights.convert_embedded
    agl.policy.weights.convert_embedded = no_gguf
    try:
        built = build_tiny(tmp_path / "cache", dict(tiny_model_cfg.tiny), str(tokenizer_dir))
        again = build_tiny(tmp_path / "cache", dict(tiny_model_cfg.tiny), str(tokenizer_dir))  # from the cache
    finally:
        agl.policy.weights.convert_embedded = saved
    assert again == built and built.name != from_gguf.name  # the tokenizer folder is part of the key
    weights, reference = load_file(built / "model.safetensors"), load_file(from_gguf / "model.safetensors")
    assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights)
    ours, theirs = AutoTokenizer.from_pretrained(built), AutoTokenizer.from_pretrained(from_gguf)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert ours.apply_chat_template(chat, tokenize=True, return_dict=False) == theirs.apply_chat_template(
        chat, tokenize=True, return_dict=False
    )
    assert len(ours) == VOCABULARY


def test_a_tokenizer_folder_that_is_not_one_is_a_config_error(tiny_model_cfg, tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        build_tiny(tmp_path, dict(tiny_model_cfg.tiny), str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="holds no HF tokenizer"):
        build_tiny(tmp_path, dict(tiny_model_cfg.tiny), str(tmp_path))
    with pytest.raises(ConfigError, match="architecture 'gpt2' is not one of: llama, qwen2"):
        build_tiny(tmp_path, {**tiny_model_cfg.tiny, "architecture": "gpt2"})


@pytest.mark.parametrize("shape", list(NON_EMBEDDING))
def test_the_shapes_are_the_real_models_with_the_embedded_vocabulary(shape):
    """Each shape's config, composed as ``model=<shape>``, builds (on the meta device: no memory) a model of its
    real model's size outside the vocabulary matrices, with 49,152 tokens."""
    import transformers
    from transformers import AutoModelForCausalLM

    model = typed(ModelConfig, compose_checked(str(ROOT / "conf"), [f"model={shape}"]).model)
    assert model.path == "tiny" and model.quantization == "nf4" and model.compute_dtype == "auto"
    tiny = {k: v for k, v in plain(model.tiny).items() if v is not None and k not in ("seed", "architecture")}
    config_class = getattr(transformers, agl.policy.weights.ARCHITECTURES[model.tiny.architecture])
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config_class(vocab_size=VOCABULARY, **tiny))
    vocabulary = built.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in built.parameters())  # a tied head counts once
    assert vocabulary == VOCABULARY * model.tiny.hidden_size and model.tiny.tie_word_embeddings
    assert (total - vocabulary) == pytest.approx(NON_EMBEDDING[shape], rel=0.02)
    assert built.config.model_type == model.tiny.architecture
