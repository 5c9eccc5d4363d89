"""What replaying decoder layers in backward costs in update time (``algo.gradient_checkpointing``).

One GRPO update of ``--groups`` groups of 8 completions x ``--tokens`` random tokens, each group sharing a
``--prompt``-token prompt (150), on the
embedded model (NF4 + fresh LoRA r16, dapo, lr 0: the weights never change), with checkpointing on
and off, alternated for ``--rounds`` rounds in one process; medians. The memory it saves is
bench/memory.py --phases' (BENCHMARKS.md "Memory of the default job").

    # ~3 min; writes bench/results/checkpointing_cost.{md,json}
    PYTHONPATH=. .venv/bin/python bench/checkpointing_cost.py
    # a step of the sums recipe's shape (8 groups of 8 three-token replies to ~40-token prompts; ~1 min)
    PYTHONPATH=. .venv/bin/python bench/checkpointing_cost.py --prompt 40 --tokens 3 --groups 8 --rounds 5 \
        --name checkpointing_cost_sums
"""

from __future__ import annotations

from agl.memory import release_freed_memory  # noqa: E402

release_freed_memory()  # as harness.py: the update's allocations as in a run

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import agl.train.grpo as grpo  # noqa: E402
from agl.train.samples import Sample  # noqa: E402
from bench.common import RESULTS, load_model  # noqa: E402

PROMPT, ROWS = 150, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200, help="completion tokens per sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens of each group")
    parser.add_argument("--groups", type=int, default=1, help="groups of 8 completions, each with its own prompt")
    parser.add_argument("--name", default="checkpointing_cost", help="bench/results/<name>.{md,json}")
    args = parser.parse_args()
    argv = sys.argv[1:]

    policy = load_model("smollm2")
    rng = random.Random(0)
    samples = [
        Sample(
            rollout_id=f"{g}-{i}",
            prompt_ids=list(range(1000 + g * args.prompt, 1000 + (g + 1) * args.prompt)),
            completion_ids=[rng.randint(100, 40000) for _ in range(args.tokens)],
            mask=[1] * args.tokens,
            logprobs=[-1.0] * args.tokens,
            reward=float(i % 2),
            truncated=False,
            group=f"g{g}",
        )
        for g in range(args.groups)
        for i in range(ROWS)
    ]
    advantages = [1.0 if i % 2 else -1.0 for _ in range(args.groups) for i in range(ROWS)]
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            update = grpo.GRPOUpdate(
                policy, grpo.GRPOConfig(lr=0.0, loss={"type": "dapo"}, gradient_checkpointing=name == "on")
            )
            start = time.perf_counter()
            metrics = update.step(samples, advantages)
            row = {
                "step_s": time.perf_counter() - start,
                "forward_s": metrics["forward_s"],
                "backward_s": metrics["backward_s"],
                "tokens": metrics["train_input_tokens"],
            }
            print(f"round {round_}, checkpointing {name}: {row['step_s']:.1f} s", flush=True)
            if round_:
                runs[name].append(row)
    med = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in runs.items()}
    ratio = statistics.median(on["step_s"] / off["step_s"] for on, off in zip(runs["on"], runs["off"]))
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "prompt": args.prompt,
        "groups": args.groups,
        "rounds": args.rounds,
        "median": med,
        "on_over_off": ratio,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    tokens = med["on"]["tokens"]
    lines = [
        "# Update time with and without replaying decoder layers in backward",
        "",
        f"{result['date']}, {result['cpu']}, {result['threads']} torch threads. "
        f"One GRPO update of {args.groups} x {ROWS} x {args.tokens} completion tokens, "
        f"each group sharing a {args.prompt}-token prompt ({tokens:.0f} tokens run), medians of {args.rounds} "
        f"alternated rounds. Written by `bench/checkpointing_cost.py{' ' if argv else ''}{' '.join(argv)}`.",
        "",
        "| `algo.gradient_checkpointing` | update s | forward s | backward s | ms per token run |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {m['step_s']:.1f} | {m['forward_s']:.1f} | {m['backward_s']:.1f} | "
            f"{1000 * m['step_s'] / m['tokens']:.1f} |"
            for name, m in med.items()
        ),
        "",
        f"**on / off = {ratio:.2f}** (median of the per-round ratios).",
    ]
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
