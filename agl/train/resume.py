"""What a trainer needs to resume exactly: the task cursor, checkpoints and the metrics file.

GRPO and SFT both checkpoint after every step, in one store transaction: the LoRA weights,
the optimizer state, the cursor, and the RNG states (python, torch, the engine's sampler).
``metrics.jsonl`` is a readable copy of the store's metrics; on resume it is rewritten from
the store, so a line written for a step that never committed disappears.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from agl.errors import ConfigError
from agl.report.metrics import append_metrics, draw_curves, metrics_path, rewrite_metrics
from agl.types import Checkpoint

if TYPE_CHECKING:
    from agl.policy.load import Policy
    from agl.runtime import Runtime


class TaskCursor:
    """Walks a split in a seeded random order, epoch after epoch; its state is two ints."""

    def __init__(self, n_rows: int, seed: int, epoch: int = 0, position: int = 0):
        self.n_rows, self.seed, self.epoch, self.position = n_rows, seed, epoch, position
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def order(self) -> list[int]:
        """This epoch's permutation (shuffled once per epoch, not once per row taken)."""
        if self._order_epoch != (self.epoch, self.n_rows):
            self._order = list(range(self.n_rows))
            random.Random(self.seed * 100_003 + self.epoch).shuffle(self._order)
            self._order_epoch = (self.epoch, self.n_rows)
        return self._order

    def take(self, k: int) -> list[int]:
        picked = []
        while len(picked) < k:
            if self.position >= self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
            picked.append(self.order()[self.position])
            self.position += 1
        return picked

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}


def adapter_bytes(policy: Policy) -> bytes:
    """The LoRA's weights as safetensors bytes; never the base vocabulary matrices (they do not train)."""
    state = {
        k: v.detach().cpu().contiguous()
        for k, v in get_peft_model_state_dict(policy.model, save_embedding_layers=False).items()
    }
    return save_safetensors(state)


def load_adapter_bytes(policy: Policy, blob: bytes) -> None:
    set_peft_model_state_dict(policy.model, load_safetensors(blob))


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


async def save_checkpoint(rt: Runtime, step: int, state: dict, optimizer: torch.optim.Optimizer, metrics: dict) -> None:
    """Everything to resume after ``step``, in one store transaction.

    ``state`` is the trainer's own (JSON: cursors, stage); ``optimizer`` is the one that took this step.
    """
    rng = {"python": random.getstate(), "torch": torch.get_rng_state(), "engine": rt.engine.generator.get_state()}
    await rt.store.save_checkpoint(
        step,
        rt.policy.version,
        state=state,
        blobs={
            "adapter": adapter_bytes(rt.policy),
            "optimizer": torch_bytes(optimizer.state_dict()),
            "rng": pickle.dumps(rng),
        },
        metrics=metrics,
    )


async def resume_or_start(rt: Runtime, optimizer_for: Callable[[dict], torch.optim.Optimizer]) -> Checkpoint | None:
    """The run's state at the start of a job: the last checkpoint restored (``restore_checkpoint``)
    and metrics.jsonl rewritten from the store; or, for a fresh run (or one killed before its first
    checkpoint, whose baseline is about to be redone), its config recorded and an empty metrics
    file. None when fresh; the caller rebuilds its cursors from ``checkpoint.state``."""
    checkpoint = await rt.store.load_checkpoint()
    if checkpoint is None:
        await rt.record_config()
        metrics_path(rt.run_dir).write_text("")
        return None
    restore_checkpoint(rt, checkpoint, optimizer_for)
    rows = [{"step": s, **m} for s, m in (await rt.store.query_metrics()).items()]
    rewrite_metrics(rt.run_dir, rows)
    draw_curves(rt.run_dir)  # the curves of what the store holds, before the run goes on
    return checkpoint


def restore_checkpoint(
    rt: Runtime, checkpoint: Checkpoint, optimizer_for: Callable[[dict], torch.optim.Optimizer]
) -> None:
    """Load ``checkpoint`` into the policy, the optimizer and the RNGs (Python's, torch's, the
    engine's). ``optimizer_for(state)`` names the optimizer that saved it: a trainer with stages
    has one per stage (GRPO after an SFT warm-up)."""
    with damage_named(rt, checkpoint, "adapter"):
        load_adapter_bytes(rt.policy, checkpoint.blobs["adapter"])
    with damage_named(rt, checkpoint, "optimizer"):
        optimizer_for(checkpoint.state).load_state_dict(
            torch.load(io.BytesIO(checkpoint.blobs["optimizer"]), weights_only=False)
        )
    with damage_named(rt, checkpoint, "rng"):
        rng = pickle.loads(checkpoint.blobs["rng"])
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    rt.engine.generator.set_state(rng["engine"])
    rt.policy.version = checkpoint.policy_version


@contextlib.contextmanager
def damage_named(rt: Runtime, checkpoint: Checkpoint, part: str) -> Iterator[None]:
    """A checkpoint blob that does not load (bytes changed in the file) as one line naming the checkpoint,
    the store and what to do, not the loader's traceback; the store is left as it is."""
    try:
        yield
    except Exception as error:
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"the checkpoint of step {checkpoint.step} in {rt.store.path} is damaged ({part}: {cause}); agl does "
            f"not write over it: restore the store from a copy, or move it aside (mv {rt.store.path} "
            f"{rt.store.path}.damaged) and run again to start over"
        ) from None


async def log_baseline(rt: Runtime, eval_metrics: dict) -> None:
    """The evaluation before any update, logged as step -1 (store and metrics.jsonl)."""
    row = {"policy_version": rt.policy.version, **eval_metrics}
    await rt.store.log_metrics(-1, row)
    append_metrics(rt.run_dir, {"step": -1, **row})
