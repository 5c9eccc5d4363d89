"""What the benchmarks share: paths, the GSM8K prompts, the embedded policy, a method timer.

Benchmarks run as scripts from the project root with ``PYTHONPATH=.`` (see each one's docstring).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def gsm8k_prompts(split: str, count: int) -> list[dict]:
    """The first ``count`` rows of a GSM8K split, each with ``prompt_text``: the question in the task's cot prompt."""
    from omegaconf import OmegaConf

    from tasks.gsm8k.data import load_split

    template = OmegaConf.load(ROOT / "conf" / "task" / "gsm8k.yaml").prompts.cot
    return [{**row, "prompt_text": template.format(question=row["question"])} for row in load_split(split)[:count]]


def model_config(name: str = "smollm2", compute_dtype: str | None = None) -> Any:
    """``conf/model/<name>.yaml`` (its cache dir comes from ``AGL_CACHE``, as in every run)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    cfg.pop("defaults", None)  # Hydra's defaults list (the schema): load_policy types the rest on ModelConfig
    if compute_dtype is not None:
        cfg.compute_dtype = compute_dtype
    return cfg


def load_model(name: str = "smollm2", compute_dtype: str | None = None) -> Any:
    """The policy of ``model_config(name, compute_dtype)``, on the CPU."""
    from agl.model import load_policy

    return load_policy(model_config(name, compute_dtype), "cpu")


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
