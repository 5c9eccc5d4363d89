"""What crosses between devices while code runs: every op whose tensors sit on more than one device.

``crossings()`` records, for each op that reads or writes tensors on two devices (a ``.to(device)``, a
``copy_`` across, an index on another device), its name, the devices and the largest tensor's element
count. A step that keeps its work on the GPU shows only its inputs going in and its small outputs coming
out; a weight, an activation or a vocabulary-wide row crossing shows up by its size. A CPU scalar (a
0-dim tensor) mixed into a CUDA op is no crossing: torch passes it as a number.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclasses.dataclass(frozen=True)
class Crossing:
    op: str
    devices: tuple[str, ...]
    numel: int  # the largest tensor of the op


class _Recorder(TorchDispatchMode):
    def __init__(self, found: list[Crossing]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        placed = [t for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)]
        devices = {str(t.device) for t in placed}
        if len(devices) > 1:
            self.found.append(Crossing(str(func), tuple(sorted(devices)), max(t.numel() for t in placed)))
        return out


@contextlib.contextmanager
def crossings():
    """``with crossings() as found:`` ... ``found`` lists what crossed devices meanwhile (this thread)."""
    found: list[Crossing] = []
    with _Recorder(found):
        yield found
