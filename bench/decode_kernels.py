"""The decode step's kernels on this CPU, each against the limit it should reach: which matmul streams the
30 layers' weights fastest at 1 to 64 rows, and attention's cost at 8, 32 and 64 rows by cache dtype.

Matmuls: SmolLM2-135M's four matmul groups per layer (q/k/v stacked 960 x 576, o 576 x 576, gate/up stacked
3072 x 576, down 576 x 1536), 30 layers of distinct random weights (212 MB in bf16: what a step streams),
``rows`` rows of input, as:

  - ``bf16 W@x.T``: agl/policy/decode.py's dense step (``torch.mm(W, x.T)``);
  - ``bf16 linear``: ``F.linear`` (``x @ W.T``);
  - ``oneDNN packed``: bf16 weights reordered once by oneDNN (``mkldnn._reorder_linear_weight``);
  - ``bnb NF4``: bitsandbytes' CPU 4-bit kernel over its repacked NF4 layout (0.5 bytes a weight), called as
    agl/policy/decode.py's ``Nf4Projection`` calls it (the C function itself; ``engine.decode_4bit_rows``), without
    the LoRA; ``bnb NF4 op``: the same through bitsandbytes' ``gemv_4bit`` op and its Python wrapper;
  - ``int8`` / ``int4``: torch's weight-only kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``
    with groups of 32): a re-quantization of the weights, for the bytes they read;
  - ``fp32 W@x.T``: the float32 step.

Attention: SDPA as the step calls it (a KV group's 3 query heads packed as its query length), 30 layers,
``cached`` positions, keys and values in fp32 (today) or bf16.

Limits: bytes read / the memory probe (a sum over 1 GiB) and FLOPs / the matmul probe (2048², best of 5), taken
before and after. Variants alternate within each round; medians of ``--rounds``.

    PYTHONPATH=. .venv/bin/python bench/decode_kernels.py    # writes bench/results/decode_kernels.{md,json}
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from bench.common import RESULTS, cpu, matmul_probe, memory_probe

HIDDEN, INTERMEDIATE, LAYERS, KV_HEADS, GROUP, HEAD_DIM = 576, 1536, 30, 3, 3, 64
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def matmul_variants() -> dict[str, tuple]:
    """name -> (matmul(layer, group, x), input dtype, bytes read per step)."""
    torch.manual_seed(0)
    fp32 = [[torch.randn(n, k) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    bf16 = [[w.bfloat16() for w in layer] for layer in fp32]
    params = sum(w.numel() for layer in fp32 for w in layer)
    variants = {
        "bf16 W@x.T": (lambda i, j, x: torch.mm(bf16[i][j], x.t()), torch.bfloat16, 2 * params),
        "bf16 linear": (lambda i, j, x: F.linear(x, bf16[i][j]), torch.bfloat16, 2 * params),
    }
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w) for w in layer] for layer in bf16]
    variants["oneDNN packed"] = (
        lambda i, j, x: torch.ops.mkldnn._linear_pointwise(x, packed[i][j], None, "none", [], ""),
        torch.bfloat16,
        2 * params,
    )
    try:
        import bitsandbytes.functional as bnb

        nf4 = [
            [bnb._convert_weight_packed_for_cpu(*bnb.quantize_4bit(w, blocksize=64)) for w in layer] for layer in bf16
        ]
        from agl.policy.decode import Nf4Projection

        projections = [[Nf4Projection(packed, state, None) for packed, state in layer] for layer in nf4]
        variants["bnb NF4"] = (lambda i, j, x: projections[i][j](x), torch.bfloat16, params // 2)
        variants["bnb NF4 op"] = (
            lambda i, j, x: bnb.gemv_4bit(x, nf4[i][j][0], state=nf4[i][j][1]),
            torch.bfloat16,
            params // 2,
        )
    except Exception as error:  # no AVX512-BF16, or no bitsandbytes
        print(f"bnb NF4 left out: {error}")
    q8 = [[_int8(w) for w in layer] for layer in fp32]
    variants["int8 (re-quantized)"] = (
        lambda i, j, x: torch.ops.aten._weight_int8pack_mm(x, *q8[i][j]),
        torch.bfloat16,
        params,
    )
    q4 = [[_int4(w) for w in layer] for layer in fp32]
    variants["int4 g32 (re-quantized)"] = (
        lambda i, j, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4[i][j][0], 32, q4[i][j][1]),
        torch.bfloat16,
        params // 2,
    )
    variants["fp32 W@x.T"] = (lambda i, j, x: torch.mm(fp32[i][j], x.t()), torch.float32, 4 * params)
    return variants, params


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.bfloat16()


def _int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    blocks = w.reshape(n, k // group, group)
    low, high = blocks.amin(-1), blocks.amax(-1)
    scale = (high - low).clamp(min=1e-8) / 15
    q = torch.round((blocks - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = low + scale * 8
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), torch.stack([scale, zero], -1).transpose(
        0, 1
    ).contiguous().bfloat16()


def attention_ms(rows: int, cached: int, dtype: torch.dtype) -> float:
    q = torch.randn(rows, KV_HEADS, GROUP, HEAD_DIM, dtype=dtype)
    caches = [
        (
            torch.randn(rows, KV_HEADS, cached, HEAD_DIM, dtype=dtype),
            torch.randn(rows, KV_HEADS, cached, HEAD_DIM, dtype=dtype),
        )
        for _ in range(LAYERS)
    ]
    mask = torch.ones(rows, 1, 1, cached, dtype=torch.bool)

    def run():
        for keys, values in caches:
            F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=HEAD_DIM**-0.5)

    run()
    return timed_ms(run)


def main(args: argparse.Namespace) -> dict:
    probes = {
        "gb_s": [memory_probe()],
        "bf16_gflop_s": [matmul_probe(torch.bfloat16)],
        "fp32_gflop_s": [matmul_probe(torch.float32)],
    }
    variants, params = matmul_variants()
    matmuls = {rows: {name: [] for name in variants} for rows in args.rows}
    for round_ in range(args.rounds):
        for rows in args.rows:
            names = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
            for name in names:
                matmul, dtype, _ = variants[name]
                xs = [torch.randn(rows, k, dtype=dtype) for _, k in SHAPES]

                def step():
                    for i in range(LAYERS):
                        for j in range(4):
                            matmul(i, j, xs[j])

                step()
                matmuls[rows][name].append(timed_ms(step))
        print(f"round {round_ + 1} of matmuls done", flush=True)
    attention = {
        rows: {str(d).removeprefix("torch."): [] for d in (torch.float32, torch.bfloat16)}
        for rows in args.attention_rows
    }
    for round_ in range(args.rounds):
        for rows in args.attention_rows:
            for dtype in (torch.float32, torch.bfloat16) if round_ % 2 == 0 else (torch.bfloat16, torch.float32):
                attention[rows][str(dtype).removeprefix("torch.")].append(attention_ms(rows, args.cached, dtype))
    probes["gb_s"].append(memory_probe())
    probes["bf16_gflop_s"].append(matmul_probe(torch.bfloat16))
    probes["fp32_gflop_s"].append(matmul_probe(torch.float32))
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "probes": probes,
        "params": params,
        "bytes": {name: v[2] for name, v in variants.items()},
        "matmul_ms": {rows: {n: statistics.median(t) for n, t in by.items()} for rows, by in matmuls.items()},
        "attention_ms": {rows: {d: statistics.median(t) for d, t in by.items()} for rows, by in attention.items()},
        "cached": args.cached,
        "rounds": args.rounds,
    }


def markdown(r: dict) -> str:
    gb_s, bf16, fp32 = max(r["probes"]["gb_s"]), max(r["probes"]["bf16_gflop_s"]), max(r["probes"]["fp32_gflop_s"])
    rows_list = list(r["matmul_ms"])
    lines = [
        "# The decode step's kernels on this CPU",
        "",
        f"{r['cpu']}, {r['torch_threads']} torch threads, {r['date']}, load average at the end "
        f"{', '.join(f'{x:.1f}' for x in r['load_average'])}. Probes (before, after): memory "
        f"{', '.join(f'{x:.1f}' for x in r['probes']['gb_s'])} GB/s, bf16 matmul "
        f"{', '.join(f'{x:.0f}' for x in r['probes']['bf16_gflop_s'])} GFLOP/s, fp32 "
        f"{', '.join(f'{x:.0f}' for x in r['probes']['fp32_gflop_s'])} GFLOP/s. Medians of {r['rounds']} alternated "
        "rounds. Written by `bench/decode_kernels.py`.",
        "",
        "The 30 layers' 120 matmuls (SmolLM2-135M's shapes, distinct weights), ms a step; in brackets the share of "
        "the lower limit (bytes / memory probe, or FLOPs / that dtype's matmul probe):",
        "",
        "| kernel | MB read | " + " | ".join(f"{rows} rows" for rows in rows_list) + " |",
        "|---|---:|" + "---:|" * len(rows_list),
    ]
    for name, nbytes in r["bytes"].items():
        peak = fp32 if name.startswith("fp32") else bf16
        cells = []
        for rows in rows_list:
            ms = r["matmul_ms"][rows][name]
            limit = max(nbytes / gb_s / 1e6, 2 * int(rows) * r["params"] / peak / 1e6)
            cells.append(f"{ms:.1f} ({limit / ms:.2f})")
        lines.append(f"| {name} | {nbytes / 1e6:.0f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Attention over {r['cached']} cached positions, 30 layers, ms a step, and the limits (keys and values read "
        "once: their bytes / the memory probe):",
        "",
        "| rows | fp32 K/V | bf16 K/V | fp32 limit | bf16 limit |",
        "|---:|---:|---:|---:|---:|",
    ]
    for rows, by in r["attention_ms"].items():
        kv = int(rows) * KV_HEADS * r["cached"] * HEAD_DIM * 2 * LAYERS
        limits = f"{kv * 4 / gb_s / 1e6:.1f} | {kv * 2 / gb_s / 1e6:.1f}"
        lines.append(f"| {rows} | {by['float32']:.1f} | {by['bfloat16']:.1f} | {limits} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 32, 64])
    parser.add_argument("--attention-rows", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--cached", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = main(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "decode_kernels.md").write_text(markdown(result))
    print(markdown(result))
