"""What the benchmarks share: paths, the GSM8K prompts, the embedded policy, a method timer.

Benchmarks run as scripts from the project root with ``PYTHONPATH=.`` (see each one's docstring).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def cpu() -> str:
    """The CPU's model name and its widest matmul extension (the machines differ: BENCHMARKS.md)."""
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    kind = next((flag for flag in ("amx_bf16", "avx512_bf16", "avx2") if f" {flag}" in info), "neither")
    return f"{name}, {kind}, {os.cpu_count()} cores"


def median_range(values: list[float], digits: int = 1) -> str:
    """A table cell for repeated measurements: ``median [min, max]``."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def gsm8k_prompts(split: str, count: int) -> list[dict]:
    """The first ``count`` rows of a GSM8K split, each with ``prompt_text``: the question in the task's cot prompt."""
    from omegaconf import OmegaConf

    from tasks.gsm8k.data import load_split

    template = OmegaConf.load(ROOT / "conf" / "task" / "gsm8k.yaml").prompts.cot
    return [{**row, "prompt_text": template.format(question=row["question"])} for row in load_split(split)[:count]]


def model_config(name: str = "smollm2", compute_dtype: str | None = None) -> Any:
    """``conf/model/<name>.yaml`` (its cache dir comes from ``AGL_CACHE``, as in every run)."""
    from omegaconf import OmegaConf

    from agl.config import ModelConfig

    # the yaml holds only choices over the typed schema (agl/config/schema.py) and the yamls its defaults name
    # (conf/model/tiny.yaml: smollm2.yaml's cache_dir); merge them as Hydra does
    def choices(name: str) -> list:
        own = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
        defaults = own.pop("defaults", [])
        below = [c for d in defaults if isinstance(d, str) and d not in ("model_schema", "_self_") for c in choices(d)]
        return below + [own]

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), *choices(name))
    if compute_dtype is not None:
        cfg.compute_dtype = compute_dtype
    return cfg


def load_model(
    name: str = "smollm2", compute_dtype: str | None = None, device: str = "cpu", tokenizer: str | None = None
) -> Any:
    """The policy of ``model_config(name, compute_dtype)``, on ``device`` (``tokenizer``: ``model.tokenizer``), loaded
    on the compute thread as a job loads it (agl/policy/compute_thread.py: one OpenMP pool for the engine's steps)."""
    from agl.policy import compute_thread
    from agl.policy.load import load_policy

    cfg = model_config(name, compute_dtype)
    if tokenizer:
        cfg.tokenizer = tokenizer
    return compute_thread.call(load_policy, cfg, device)


def time_method(obj: Any, name: str, key: str, timings: dict) -> None:
    """Wrap ``obj.<name>`` so every call adds its wall time to ``timings[key]``."""
    method = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timings[key] += time.perf_counter() - start

    setattr(obj, name, timed)


def record_decode_steps(engine: Any) -> list[tuple[int, int]]:
    """Wrap the engine's decode step so each call appends (rows, cached width + 1) to the list returned."""
    steps: list[tuple[int, int]] = []
    decode = engine._decode

    def logged_decode(batch):
        steps.append((len(batch.seqs), batch.mask.shape[1] + 1))
        return decode(batch)

    engine._decode = logged_decode
    return steps


def timed(fn: Any) -> float:
    """Seconds one call of ``fn()`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_probe(dtype: Any, n: int = 2048, rounds: int = 5, warmup: int = 1, device: str = "cpu") -> float:
    """GFLOP/s of an n x n matmul in ``dtype`` (a torch dtype) on ``device``, best of ``rounds`` after ``warmup``
    calls (on a GPU each timed call waits for the product: ``synchronize``). On the compute thread, as the probes
    below: a probe from another thread would start a second OpenMP pool beside the engine's."""
    from agl.policy import compute_thread

    return compute_thread.call(_matmul_probe, dtype, n, rounds, warmup, device)


def _matmul_probe(dtype: Any, n: int, rounds: int, warmup: int, device: str) -> float:
    import torch

    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        a @ b
    sync()
    best = min(timed(lambda: (a @ b, sync())) for _ in range(rounds))
    return 2 * n**3 / best / 1e9


def memory_probe(gib: float = 1.0, rounds: int = 5) -> float:
    """GB/s reading a ``gib`` GiB float32 tensor (a sum), best of ``rounds``, on the compute thread."""
    from agl.policy import compute_thread

    return compute_thread.call(_memory_probe, gib, rounds)


def _memory_probe(gib: float, rounds: int) -> float:
    import torch

    data = torch.ones(int(gib * 2**30) // 4)
    best = min(timed(data.sum) for _ in range(rounds))
    return data.numel() * 4 / best / 1e9


def decode_inputs(config: Any, rows: int, cached: int) -> tuple:
    """A decode step's arguments (tokens, positions, mask, cache) for ``rows`` rows that each have
    ``cached`` positions of random float32 keys and values in a slot cache."""
    import torch

    from agl.policy.kv_cache import cache_from_tensors

    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    shape = (rows, kv_heads, cached, head_dim)
    cache = cache_from_tensors([(torch.randn(shape), torch.randn(shape)) for _ in range(config.num_hidden_layers)])
    return (
        torch.randint(0, 1000, (rows,)),
        torch.full((rows,), cached),
        torch.ones(rows, cached + 1, dtype=torch.long),
        cache,
    )


def drop_appended(cache: Any, cached: int) -> None:
    """Cut every layer back to ``cached`` positions, so each timed step sees the same cache length."""
    for layer in cache.layers:
        layer.crop(cached - layer.get_seq_length())
