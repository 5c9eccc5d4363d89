"""What differs on a CUDA device: which device a run gets, its peak memory in the metrics, and deterministic
kernels for exact runs.

- ``resolve_device``: ``device=`` as a torch device, or the one-line error a user can act on (checked as the job
  starts, before its modules and its model load: agl.jobs.dispatch).

- ``device_memory``: the GPU's peak allocated memory so far (``torch.cuda.max_memory_allocated``), which
  the trainers add to every metrics.jsonl row as ``peak_vram_mib`` next to the process's peak RSS. Peak,
  not current: it is what decides whether a batch, a length or a model fits. Nothing on a CPU.
- ``deterministic_kernels``: an exact run (float32, ``engine.batch_invariant``: agl.runtime) on CUDA asks
  torch for deterministic algorithms, so one seed gives one run there too (tests/test_reproducible.py, on
  the CUDA lane). cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first matmul: ``harness.py``
  sets it when a run will use CUDA (agl.memory.runs_on_cuda). Not ``warn_only``: an op with no
  deterministic CUDA kernel stops the run with torch's error naming it, since an exact run that is not exact is
  worse than none. Strict mode is also what turns deterministic kernels on where torch has both: with
  ``warn_only=True`` the backward of scaled-dot-product attention only warns and stays nondeterministic
  (docs/benchmarks-history.md#cuda-deterministic-kernels).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch

from agl.errors import ConfigError

CUBLAS_WORKSPACE = ":4096:8"  # the setting torch's reproducibility notes give for deterministic cuBLAS


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"device '{device}' is not one of: auto, cpu, cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device '{device}' was asked for, but torch sees no CUDA device")
    return torch.device(device)


def device_memory(device: torch.device | str) -> dict[str, float]:
    """``{"peak_vram_mib": ...}`` for a CUDA ``device`` (its peak allocated memory so far), else ``{}``."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {"peak_vram_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)}


@contextlib.contextmanager
def deterministic_kernels(device: torch.device | str) -> Iterator[bool]:
    """Within: torch's deterministic algorithms on for an exact run on CUDA (yields True); elsewhere nothing
    (yields False). The setting is process-wide: the one before is given back on leaving.

    On a CPU the float32 kernels agl runs are deterministic already (the batch-invariant engine makes
    them independent of scheduling too), and the setting would only add checks.
    """
    if torch.device(device).type != "cuda":
        yield False
        return
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE  # in time only if cuBLAS has not started yet
        warnings.warn(
            "CUBLAS_WORKSPACE_CONFIG was not set before CUDA started; harness.py sets it, a library user must "
            f"(export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE}) for cuBLAS to be deterministic",
            stacklevel=2,
        )
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield True
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
