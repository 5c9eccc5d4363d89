"""Where a run's randomness comes from, so that one seed gives one run.

Two sources, both derived from the run's ``seed``:

* **The process RNGs** (python, numpy, torch) are seeded once when a job starts, before the
  model is built, so the LoRA's initial weights and anything else drawn from them repeat.
  Checkpoints carry their states, so a resumed run continues the same streams.
* **Sampling.** A call on a rollout route that sends no ``seed`` gets one derived from the
  run seed and the call's stable identity: its rollout, the rollout's *charged* attempt
  number (harness deaths do not count, so a rerun after ``kill -9`` samples exactly what the
  interrupted try would have) and the call's number inside the attempt. What a call samples
  then depends on what it is, not on when asyncio or the engine's batch happened to run it.
  A request's own ``seed`` is used as given.
"""

from __future__ import annotations

import collections
import hashlib
import random
from typing import Any

SEED_BITS = 63  # torch.Generator.manual_seed takes any non-negative int below 2**64


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global RNGs (all devices)."""
    import numpy as np  # here, not at the top: report= imports this module and loads no torch
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def call_seed(run_seed: int, rollout_id: str, attempt: int, call: int) -> int:
    """The sampling seed of call ``call`` (0, 1, ...) of charged attempt ``attempt`` of a rollout.

    A hash, not arithmetic, so that nearby identities get unrelated streams.

    >>> call_seed(0, "ro-000001", 1, 0) == call_seed(0, "ro-000001", 1, 0)
    True
    >>> len({call_seed(0, "ro-000001", 1, c) for c in range(100)})
    100
    """
    key = f"{run_seed}/{rollout_id}/{attempt}/{call}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> (64 - SEED_BITS)


class CallCounter:
    """Numbers each attempt's calls in arrival order: 0, 1, 2, ...

    Arrival order is the agent's own order for calls it makes one after another. Two cases are
    not reproducible: calls an agent sends concurrently are numbered as the route gets to them,
    and a request the client re-sends (the openai client retries timeouts) takes a number too,
    shifting the calls after it. Bounded: the attempts
    idle longest are forgotten first, long after they can have finished.
    """

    def __init__(self, max_attempts: int = 65536):
        self.max_attempts = max_attempts
        self._counts: collections.OrderedDict[Any, int] = collections.OrderedDict()

    def next(self, key: Any) -> int:
        number = self._counts.pop(key, 0)
        self._counts[key] = number + 1
        while len(self._counts) > self.max_attempts:
            self._counts.popitem(last=False)
        return number
