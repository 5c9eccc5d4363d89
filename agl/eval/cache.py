"""The eval cache: a greedy eval's score rows, kept per problem, for every later run that would compute them.

The base model's eval is the same computation in every run and in every job of a sweep (27 minutes of a
GSM8K job's 56 on the AMX machine). An entry holds what one setting of an eval computed, one file per
problem; an eval looks its problems up first and runs only the ones missing (``agl.eval.evaluate``).

Layout, under ``eval_cache.dir`` (default ``$AGL_EVAL_CACHE``, else ``$AGL_CACHE/evals``, else
``~/.cache/agl/evals``)::

    <digest[:2]>/<digest>/key.json         what the entry's digest was made of (``eval_components``)
    <digest[:2]>/<digest>/rows/<row>.json  one problem's score row, its last reply, its kind and a checksum
    <digest[:2]>/<digest>/lock             held (flock) by the process computing this entry's rows

The entry's key is everything that decides a greedy eval's scores: the base weights (the model cache's
manifest, or the files' checksums), the adapter (none when the LoRA adds nothing: a fresh LoRA's B is zero,
so every job's baseline of a sweep shares one entry, whatever its seed), the task's name and agent source, the
resources (prompt template and the agent's arguments), the decoding (greedy, ``max_tokens``; the agent sets any
stops, and its source is in the key), the numerics (compute dtype, quantization, batch invariance, the engine's
weights and decode paths, the device and its CPU capability) and agl's code that computes a score (the policy,
the route, the agent API, ``rollout_scores``) with the versions of torch, transformers, peft and bitsandbytes.
agl's code is in the key because an exact row is only a replay of the code that computed it: a change to the
engine or the route recomputes, which costs one eval, where a stale row would silently misreport one.
A row's key is its split, task id, content and try, so an eval of the first 100 problems reuses a whole-split
eval's rows. Sampled evals (temperature > 0) are not cached: their rollouts' seeds follow their store ids.

Kinds. ``exact`` rows come from a batch-invariant engine (the float32 default): a row is then a function of
its key alone, and reusing it is a bit-for-bit replay. ``sample`` rows come from a batched engine (bf16): a
row depends, by a rounding now and then, on which rows shared its batch, so a reused row is an equally valid
sample of the same eval, not its replay. ``eval_cache.reuse=exact`` reuses exact rows only.

Crash safety. A row is written to a temporary file and renamed into place: it is there whole or not at all,
so a killed eval keeps its finished rows and the next run computes only the rest. Failed rollouts are not
kept (a timeout says nothing about the model). A row that fails its checksum or cannot be read, and an entry
whose key.json does not match its digest, are recomputed, with one warning line: a cache may recompute; it
is never trusted silently. Parallel jobs: the process computing an entry's missing rows holds its lock; a
job needing the same entry waits for it (polling, so it can still be cancelled), then computes only what is
still missing. The kernel drops a killed process's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.config import EvalCacheConfig
from agl.errors import ConfigError
from agl.policy.weights import MANIFEST, file_sha256

if TYPE_CHECKING:
    import torch

    from agl.runtime import Runtime

log = logging.getLogger(__name__)

FORMAT = 1  # of key.json and the row files; another format is a stale entry
REUSE = ("any", "exact", "off")
EXACT, SAMPLE = "exact", "sample"
# agl's code that decides what a rollout scores: the policy and its engine, the route, the agents' API,
# rollout_scores (agl/eval/evaluate.py), and the call seeds (agl/seeding.py)
CODE_PACKAGES = ("policy", "route", "agents")
CODE_FILES = ("eval/evaluate.py", "seeding.py")
LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")
WAIT_POLL_S = 0.5
AGL_ROOT = Path(__file__).resolve().parents[1]


def cache_root(directory: str | None = None) -> Path:
    """``eval_cache.dir``, else ``$AGL_EVAL_CACHE``, else ``$AGL_CACHE/evals``, else ``~/.cache/agl/evals``."""
    if directory:
        return Path(directory).expanduser()
    if env := os.environ.get("AGL_EVAL_CACHE"):
        return Path(env).expanduser()
    return Path(os.environ.get("AGL_CACHE") or "~/.cache/agl").expanduser() / "evals"


def canonical(obj: Any) -> bytes:
    """``obj`` as JSON with sorted keys and no spaces: the bytes its digest is taken of."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def digest(obj: Any) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()


# ----------------------------------------------------------------------------- the key's components


@functools.cache
def weights_digest(source: str) -> str:
    """The base weights' identity: the model cache's manifest (every file's sha256, agl/policy/weights.py),
    else every file's sha256; a hub id (not a local dir) is its own name."""
    path = Path(source)
    if not path.is_dir():
        return f"hub:{source}"
    manifest = path / MANIFEST
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
    return digest({p.name: file_sha256(p) for p in files})


LORA_PAIRS = (("lora_embedding_A", "lora_embedding_B"), ("lora_A", "lora_B"))


def adds_nothing(state: Mapping[str, Any]) -> bool:
    """True when a LoRA state dict changes no output: every module's pair has an all-zero member (a fresh
    LoRA's B, a fresh embedding LoRA's A), and there is nothing else (no module saved whole)."""
    pairs: dict[str, list[Any]] = {}
    for name, tensor in state.items():
        pair = next(((a, b) for a, b in LORA_PAIRS if a in name or b in name), None)
        if pair is None:
            return False
        pairs.setdefault(name.replace(pair[1], pair[0]), []).append(tensor)
    return all(any(not bool(t.any()) for t in tensors) for tensors in pairs.values())


def adapter_digest(model: torch.nn.Module) -> str | None:
    """The LoRA's identity: None when it adds nothing (``adds_nothing``), else the sha256 of its weights and of
    the settings that scale them (r, alpha, rsLoRA, DoRA, the target modules)."""
    import torch
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    if adds_nothing(state):
        return None
    h = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    config = model.peft_config[model.active_adapter]
    targets = config.target_modules
    settings = {
        "r": config.r,
        "alpha": config.lora_alpha,
        "rslora": bool(getattr(config, "use_rslora", False)),
        "dora": bool(getattr(config, "use_dora", False)),
        "targets": sorted(targets) if isinstance(targets, (set, list, tuple)) else str(targets),
    }
    h.update(canonical(settings))
    return h.hexdigest()


def source_digest(fn: Callable) -> str:
    """The agent's source: its module, and every module of its package when it is in one (a task's scoring
    helpers next to its agent). Modules it imports from elsewhere are not followed."""
    try:
        path = Path(inspect.getsourcefile(inspect.unwrap(fn)) or "")
    except TypeError:  # a builtin or C function: its qualified name is all there is
        return f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', repr(fn))}"
    if not path.is_file():
        return f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', repr(fn))}"
    files = sorted(path.parent.glob("*.py")) if (path.parent / "__init__.py").is_file() else [path]
    return digest({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files})


@functools.cache
def code_digest(root: Path = AGL_ROOT) -> str:
    """agl's code that computes a score (``CODE_PACKAGES``, ``CODE_FILES`` under ``root``, agl's package dir) and
    the numerics libraries' versions."""
    files = sorted(p for package in CODE_PACKAGES for p in (root / package).glob("*.py"))
    files += [root / name for name in CODE_FILES]
    sources = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    libraries = {}
    for name in LIBRARIES:
        try:
            libraries[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            libraries[name] = None
    return digest({"sources": sources, "libraries": libraries})


def device_numerics(device: Any) -> str:
    """What a device's float results depend on besides the dtype: a CPU's vector ISA, a GPU's name."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{torch.backends.cpu.get_cpu_capability()}"


def eval_components(rt: Runtime, resources: Mapping[str, Any], sampling: Mapping[str, Any]) -> dict:
    """The key of the eval ``rt`` (an ``agl.runtime.Runtime``) runs with ``resources`` and ``sampling`` now."""
    policy, model, engine = rt.policy, rt.model_config, rt.engine_config
    return {
        "weights": weights_digest(policy.source),
        "adapter": adapter_digest(policy.model),
        "task": rt.task_config.name,
        "agent": source_digest(rt.task.agent),
        "resources": dict(resources),
        "decoding": {"temperature": float(sampling.get("temperature", 0.0)), "max_tokens": sampling.get("max_tokens")},
        "numerics": {
            "compute_dtype": str(policy.compute_dtype).removeprefix("torch."),
            "quantization": model.quantization,
            "double_quant": bool(model.double_quant),
            "batch_invariant": bool(rt.engine.batch_invariant),
            "engine_weights": engine.weights,
            "decode": engine.decode,
            "device": device_numerics(policy.device),
        },
        "code": code_digest(),
    }


def row_key(split: str | None, row: Any, attempt: int) -> str:
    """One problem's key within an entry: its split, task id, content and try."""
    task_id = row.get("id") if isinstance(row, Mapping) else None
    return digest([split, task_id, row, attempt])[:32]


# ----------------------------------------------------------------------------- entries


class EvalCache:
    """``eval_cache.*``: where entries live and which rows may be reused."""

    def __init__(self, config: EvalCacheConfig | None = None):
        config = config or EvalCacheConfig()
        if config.reuse not in REUSE:
            raise ConfigError(f"eval_cache.reuse must be one of {', '.join(REUSE)}, not {config.reuse!r}")
        self.root, self.reuse = cache_root(config.dir), config.reuse

    @property
    def enabled(self) -> bool:
        return self.reuse != "off"

    def entry(self, components: Mapping[str, Any]) -> CacheEntry:
        """The entry of ``components`` (``eval_components``), created or checked: a key.json that does not
        match (stale, edited, another format) empties it, with a warning."""
        components = json.loads(canonical(components))  # tuples as lists: what key.json reads back as
        key = digest({"format": FORMAT, "components": components})
        path = self.root / key[:2] / key
        kind = EXACT if components["numerics"]["batch_invariant"] else SAMPLE
        entry = CacheEntry(path, key, kind, readable=self.reuse == "any" or kind == EXACT)
        entry.open({"format": FORMAT, "digest": key, "components": components})
        return entry


class CacheEntry:
    """One setting of an eval: its rows, and the lock of the process computing them."""

    def __init__(self, path: Path, key: str, kind: str, readable: bool):
        self.path, self.key, self.kind, self.readable = path, key, kind, readable
        self.rows_dir = path / "rows"
        self.written = 0  # rows this process wrote

    def open(self, expected: dict) -> None:
        key_file = self.path / "key.json"
        self.rows_dir.mkdir(parents=True, exist_ok=True)
        try:
            found = json.loads(key_file.read_text())
        except FileNotFoundError:
            _write_atomically(key_file, canonical(expected))
            return
        except (OSError, ValueError):
            found = None
        if found != expected:
            log.warning("eval cache: %s does not match its key (stale or damaged); recomputing its rows", self.path)
            trash = Path(tempfile.mkdtemp(prefix=".stale-", dir=self.path))
            os.replace(self.rows_dir, trash / "rows")  # in one rename: a reader sees all the old rows or none
            shutil.rmtree(trash, ignore_errors=True)
            self.rows_dir.mkdir(exist_ok=True)
            _write_atomically(key_file, canonical(expected))

    def row_path(self, key: str) -> Path:
        return self.rows_dir / f"{key}.json"

    def read(self, keys: Sequence[str]) -> dict[str, dict]:
        """The valid rows among ``keys``. A row that fails its checksum or cannot be read is removed (the eval
        recomputes it), with one warning for all of them."""
        found, damaged = {}, 0
        for key in dict.fromkeys(keys):
            path = self.row_path(key)
            try:
                record = json.loads(path.read_bytes())
            except FileNotFoundError:
                continue
            except (OSError, ValueError):
                record = None
            if self._valid(record, key):
                found[key] = record
            else:
                damaged += 1
                with contextlib.suppress(OSError):
                    path.unlink()
        if damaged:
            log.warning(
                "eval cache: %d row(s) of %s failed their checksum or could not be read; recomputing them",
                damaged,
                self.path,
            )
        return found

    def _valid(self, record: Any, key: str) -> bool:
        if not isinstance(record, dict) or "sha256" not in record:
            return False
        body = {k: v for k, v in record.items() if k != "sha256"}
        return (
            record["sha256"] == hashlib.sha256(canonical(body)).hexdigest()
            and body.get("format") == FORMAT
            and body.get("entry") == self.key
            and body.get("row") == key
            and body.get("kind") in (EXACT, SAMPLE)
            and isinstance(body.get("score"), dict)
        )

    def write(self, key: str, *, task_id: Any, attempt: int, score: dict, reply: str | None) -> None:
        """Keep one finished problem's row (whole or not at all: a temporary file renamed into place)."""
        body = {
            "format": FORMAT,
            "entry": self.key,
            "row": key,
            "task_id": task_id,
            "try": attempt,
            "kind": self.kind,
            "score": score,
            "reply": reply,
        }
        body["sha256"] = hashlib.sha256(canonical(body)).hexdigest()
        _write_atomically(self.row_path(key), canonical(body))
        self.written += 1

    @contextlib.asynccontextmanager
    async def computing(self, announce: Callable[[str], None] = print) -> AsyncIterator[None]:
        """Hold the entry's lock while this process computes its missing rows. Another process holding it is
        computing the same rows: say so once, and wait (polling) until it is done or dead."""
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            waited = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not waited:
                        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                        announce(
                            f"eval cache: waiting for process {holder}, which is computing these rows: {self.path}"
                        )
                        waited = True
                    await asyncio.sleep(WAIT_POLL_S)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # releases the lock


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
