"""How many torch ops one decode step issues, per layer and for a shape's depth: the count behind a GPU decode
step's fixed cost (docs/gpu.md, "Measured on an H200").

    PYTHONPATH=. python bench/decode_ops.py            # writes bench/results/decode_ops.{json,md}

Eager PyTorch pays its dispatch (Python, the dispatcher, a kernel launch) once per op, whatever the batch. On the
H200 the route's step cost about 33 ms at any batch against 0.7 ms of memory traffic; that over the op count
here is the cost of one op, which CUDA graphs would replace by a replay of the recorded kernels.

The count is taken on the CPU, on random-weight models of a shape's architecture at 2 and 4 layers (a
``TorchDispatchMode`` counting every aten op of one step of the fast decode over merged sampler weights, ``ROWS`` rows),
and extended to the shape's depth: ops = fixed + per layer x layers. On CUDA the same Python issues the same ops.
Views (``view``, ``t``, ``slice``, ...) are counted apart: they launch no kernel but still cost a dispatch; so may
some of the others (a ``to`` a tensor already has).
"""

from __future__ import annotations

import collections
import json
from datetime import datetime

import torch
from common import RESULTS, decode_inputs, drop_appended, model_config
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from agl.policy.decode import decode_step
from agl.policy.load import load_policy
from agl.policy.sampler_weights import MergedSampler

SHAPES = ("shape_smollm2_135m", "shape_qwen25_15b")
VIEWS = {"view", "_unsafe_view", "t", "slice", "unsqueeze", "squeeze", "expand", "transpose", "permute", "select"}
ROWS = 8  # rows in the counted step
H200_STEP_MS = 33.0  # the route's fixed cost a step on the H200 (bench/results/gpu_route.md: 34 ms at 1 client)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_step(shape: str, layers: int, rows: int = ROWS, cached: int = 16) -> collections.Counter[str]:
    """The aten ops of one decode step of ``shape``'s architecture at ``layers`` layers and a tiny width."""
    cfg = model_config(shape)
    heads = cfg.tiny.num_attention_heads  # the shape's heads and kv heads (the grouping), 8 dims each
    cfg.tiny = OmegaConf.merge(
        cfg.tiny, {"num_hidden_layers": layers, "hidden_size": 8 * heads, "intermediate_size": 128}
    )
    cfg.compute_dtype = "float32"
    policy = load_policy(cfg, "cpu")
    policy.model.eval()
    merged = MergedSampler(policy.model, policy.compute_dtype)
    step = decode_step(merged)
    tokens, positions, mask, cache = decode_inputs(merged.model().config, rows, cached)
    with torch.inference_mode():
        step(tokens, positions, mask, cache)  # warm: first-call paths (cache growth, lazy buffers) out of the count
        drop_appended(cache, cached)
        with OpCounter() as counter:
            step(tokens, positions, mask, cache)
    return counter.ops


def main() -> None:
    rows = []
    for shape in SHAPES:
        depth = model_config(shape).tiny.num_hidden_layers
        two, four = count_step(shape, 2), count_step(shape, 4)
        per_layer = {k: (four[k] - two[k]) / 2 for k in four}
        fixed = {k: two[k] - 2 * per_layer[k] for k in two}

        def at(layers: int, views: bool | None = None) -> int:
            keep = lambda k: views is None or (k in VIEWS) == views
            return round(
                sum(v for k, v in fixed.items() if keep(k)) + layers * sum(v for k, v in per_layer.items() if keep(k))
            )

        rows.append(
            {
                "shape": shape,
                "layers": depth,
                "ops_fixed": at(0),
                "ops_per_layer": at(1) - at(0),
                "ops_per_step": at(depth),
                "non_view_ops_per_step": at(depth, views=False),
                "views_per_step": at(depth, views=True),
                "top_per_layer": sorted(per_layer.items(), key=lambda kv: -kv[1])[:8],
            }
        )
    for row in rows:  # the fixed cost was measured at the 1.5B shape only
        measured = row["shape"] == "shape_qwen25_15b"
        row["us_per_op_at_h200_step"] = round(H200_STEP_MS * 1000 / row["ops_per_step"], 1) if measured else None
    out = {"date": datetime.now().strftime("%Y-%m-%d %H:%M"), "rows_in_step": ROWS, "shapes": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "decode_ops.json").write_text(json.dumps(out, indent=1))
    lines = [
        "# Torch ops in one decode step (fast decode, merged sampler weights)",
        "",
        f"{out['date']}. Counted on the CPU at 2 and 4 layers, extended to each shape's depth "
        "(`PYTHONPATH=. python bench/decode_ops.py`). The last column divides the H200's measured fixed step "
        f"cost ({H200_STEP_MS:.0f} ms, the route at 1 client, Qwen2.5-1.5B shape) by the op count.",
        "",
        "| shape | layers | ops fixed | ops per layer | ops per step | not views | views | µs per op at 33 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['layers']} | {r['ops_fixed']} | {r['ops_per_layer']} | {r['ops_per_step']:,} "
            f"| {r['non_view_ops_per_step']:,} | {r['views_per_step']:,} "
            f"| {r['us_per_op_at_h200_step'] or 'not measured'} |"
        )
    lines += ["", "Most frequent per layer: " + ", ".join(f"{k} {v:g}" for k, v in rows[-1]["top_per_layer"])]
    (RESULTS / "decode_ops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
