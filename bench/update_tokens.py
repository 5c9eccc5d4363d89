"""GRPO update time against the tokens it trains on: the planner before token budgets vs. now.

Workload: one GRPO step of the default job's shape on the embedded model (NF4 + fresh LoRA r16,
compute dtype ``auto``, ``loss_type`` dapo, lr 0 so the LoRA stays as loaded): B 4 GSM8K train
questions x G 8 samples, prompts of 150-250 tokens (the first train questions whose rendered
prompt is that long; the default cot prompt averages ~113), and two completion-length mixes:
``long`` (mean ~230 of at most 256 tokens, most cut at 256: early in a run) and ``short`` (mean
~75, spread from 12 to 163: late in a run); gamma-distributed lengths, fixed seed. Completion token
ids are random: the cost does not depend on them.

Planners, run on the same samples:
  - ``old``: the planner before token budgets (``old_plan``, copied here): each group in one
    micro-batch of ``micro_batch_size`` 8, every completion padded to the group's longest;
  - ``new``: ``agl.train.micro_batches.plan_micro_batches`` with the defaults (conf/algo/grpo.yaml):
    sorted by length and cut where padding costs more than a pass, at most ``micro_batch_tokens``
    per pass.

Per step: wall time, tokens run (real and padded), the loss (old and new must agree), and the
step's RSS peak above the RSS before it (a sampling thread, every 5 ms; glibc's mmap threshold is
pinned as harness.py does, so freed activations leave the RSS). All four (planner, mix) steps
run in each round, in an order that alternates; reported are medians over rounds of per-round
ratios, as this shared CPU's speed moves from minute to minute.

    # writes bench/results/update_tokens.{md,json}
    PYTHONPATH=. .venv/bin/python bench/update_tokens.py [--rounds 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see harness.py

from agl.memory import release_freed_memory  # noqa: E402

release_freed_memory()  # as harness.py: before torch allocates

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

from bench.common import RESULTS, gsm8k_prompts, load_model  # noqa: E402

B, G, MAX_TOKENS = 4, 8, 256
MIXES = {"long": 230, "short": 75}  # target mean completion length


def old_plan(samples: Sequence, size: int, tokens: int | None = None) -> list[list[int]]:
    """agl.train.micro_batches.plan_micro_batches before token budgets (commit a1b3332): groups whole, in chunks of
    ``size``."""
    by_prompt: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, sample in enumerate(samples):
        by_prompt[tuple(sample.prompt_ids)].append(i)
    shared = [idx for idx in by_prompt.values() if len(idx) > 1]
    singles = sorted(
        (idx[0] for idx in by_prompt.values() if len(idx) == 1),
        key=lambda i: len(samples[i].prompt_ids) + len(samples[i].completion_ids),
    )
    plan = [idx[i : i + size] for idx in shared for i in range(0, len(idx), size)]
    return plan + [singles[i : i + size] for i in range(0, len(singles), size)]


def completion_lengths(mean: int, seed: int) -> list[int]:
    """B x G lengths: gamma(shape 3) draws, scaled so that the mean after the cut at 256 is ``mean``."""

    def draw(scale: float) -> list[int]:
        rng = random.Random(seed)
        return [min(MAX_TOKENS, max(8, round(rng.gammavariate(3.0, scale)))) for _ in range(B * G)]

    low, high = 1.0, 1000.0
    for _ in range(60):  # bisect the scale: the clipped mean grows with it
        mid = (low + high) / 2
        low, high = (mid, high) if statistics.mean(draw(mid)) < mean else (low, mid)
    return draw(high)


def make_samples(policy, mix: str) -> list:
    from agl.train.samples import Sample

    rows = [
        r
        for r in gsm8k_prompts("train", 400)
        if 150 <= len(policy.render_chat([{"role": "user", "content": r["prompt_text"]}])) <= 250
    ][:B]
    prompts = [policy.render_chat([{"role": "user", "content": r["prompt_text"]}]) for r in rows]
    lengths = completion_lengths(MIXES[mix], seed=13)
    rng = random.Random(7)
    samples = []
    for g, prompt in enumerate(prompts):
        for j in range(G):
            n = lengths[g * G + j]
            samples.append(
                Sample(
                    rollout_id=f"{g}-{j}",
                    prompt_ids=prompt,
                    completion_ids=[rng.randint(100, 40000) for _ in range(n)],
                    mask=[1] * n,
                    logprobs=[-1.0] * n,
                    reward=float(j % 2),
                    truncated=n == MAX_TOKENS,
                    temperature=0.8,
                    group=str(g),
                )
            )
    return samples


def padded_tokens(samples: Sequence, plan: list[list[int]]) -> int:
    """Tokens the passes run, padding included (a group's prompt once)."""
    total, seen = 0, set()
    for chunk in plan:
        prompt = tuple(samples[chunk[0]].prompt_ids)
        total += len(chunk) * max(len(samples[i].completion_ids) for i in chunk) + (
            0 if prompt in seen else len(prompt)
        )
        seen.add(prompt)
    return total


class PeakRSS:
    """The largest RSS seen (every 5 ms) while the block runs, minus the RSS when it began."""

    def __enter__(self) -> PeakRSS:
        self.process, self.stop = psutil.Process(), threading.Event()
        self.start = self.peak = self.process.memory_info().rss

        def sample() -> None:
            while not self.stop.wait(0.005):
                self.peak = max(self.peak, self.process.memory_info().rss)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def mib(self) -> float:
        return (self.peak - self.start) / 2**20


def run_step(policy, samples: list, planner: str) -> dict:
    import agl.train.grpo as grpo
    import agl.train.micro_batches as micro_batches

    # the defaults: micro_batch_size, micro_batch_tokens as in grpo.yaml
    config = grpo.GRPOConfig(lr=0.0, loss={"type": "dapo", "epsilon_high": None})
    plan_fn = micro_batches.plan_micro_batches
    if planner == "old":
        config.micro_batch_size, config.micro_batch_tokens = 8, None
        micro_batches.plan_micro_batches = old_plan
    try:
        plan = micro_batches.plan_micro_batches(samples, config.micro_batch_size, config.micro_batch_tokens)
        update = grpo.GRPOUpdate(policy, config)
        advantages = [1.0 if j % 2 else -1.0 for j in range(len(samples))]
        with PeakRSS() as rss:
            start = time.perf_counter()
            metrics = update.step(samples, advantages)
            seconds = time.perf_counter() - start
    finally:
        micro_batches.plan_micro_batches = plan_fn
    return {
        "step_s": seconds,
        "forward_s": metrics["forward_s"],
        "backward_s": metrics["backward_s"],
        "loss": metrics["loss"],
        "micro_batches": len(plan),
        "real_tokens": int(metrics["train_input_tokens"]),
        "padded_tokens": padded_tokens(samples, plan),
        "rss_peak_mib": rss.mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    policy = load_model()
    samples = {mix: make_samples(policy, mix) for mix in MIXES}
    cases = [(planner, mix) for mix in MIXES for planner in ("old", "new")]
    run_step(policy, samples["short"], "new")  # warm-up
    rows: dict[str, list[dict]] = {f"{p} {m}": [] for p, m in cases}
    for round_ in range(args.rounds):
        order = cases if round_ % 2 == 0 else cases[::-1]
        for planner, mix in order:
            rows[f"{planner} {mix}"].append(run_step(policy, samples[mix], planner))
        print(
            f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]['step_s']:.1f} s" for k, v in rows.items()),
            flush=True,
        )

    def ratio(a: str, b: str, key: str = "step_s") -> dict:
        per_round = [x[key] / y[key] for x, y in zip(rows[a], rows[b])]
        return {"median": statistics.median(per_round), "per_round": per_round}

    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "prompt_tokens": sorted({len(s.prompt_ids) for s in samples["long"]}),
        "completion_tokens": {
            mix: {
                "mean": statistics.mean(len(s.completion_ids) for s in samples[mix]),
                "cut_at_max": sum(s.truncated for s in samples[mix]),
            }
            for mix in MIXES
        },
        "steps": {k: {key: statistics.median(r[key] for r in v) for key in v[0]} for k, v in rows.items()},
        "ratios": {
            "new / old, long": ratio("new long", "old long"),
            "new / old, short": ratio("new short", "old short"),
            "short / long, old": ratio("old short", "old long"),
            "short / long, new": ratio("new short", "new long"),
        },
        "loss_diff": {mix: abs(rows[f"new {mix}"][0]["loss"] - rows[f"old {mix}"][0]["loss"]) for mix in MIXES},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "update_tokens.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "update_tokens.md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    s, q, c = r["steps"], r["ratios"], r["completion_tokens"]
    tokens = {p: s[f"{p} short"]["real_tokens"] / s[f"{p} long"]["real_tokens"] for p in ("old", "new")}
    lines = [
        "# GRPO update time against the tokens it trains on: planner before token budgets (old) vs. now (new)",
        "",
        f"{r['date']}. SmolLM2-135M-Instruct NF4 + LoRA r16, compute dtype auto, "
        f"CPU ({r['threads']} threads, shared with other jobs), "
        f"one GRPO step (dapo) of {B} GSM8K prompts ({', '.join(map(str, r['prompt_tokens']))} tokens) x {G} samples. "
        f"Completions: long mean {c['long']['mean']:.0f} tokens ({c['long']['cut_at_max']} of 32 cut at {MAX_TOKENS}), "
        f"short mean {c['short']['mean']:.0f} ({c['short']['cut_at_max']} cut). "
        f"Medians of {r['rounds']} alternated rounds. "
        "Written by `bench/update_tokens.py`.",
        "",
        "| completions | planner | micro-batches | tokens run: real / padded | step s (forward / backward) "
        "| RSS peak above start, MiB |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {k.split()[1]} | {k.split()[0]} | {v['micro_batches']:.0f} | "
            f"{v['real_tokens']:.0f} / {v['padded_tokens']:.0f} | "
            f"{v['step_s']:.1f} ({v['forward_s']:.1f} / {v['backward_s']:.1f}) | {v['rss_peak_mib']:.0f} |"
            for k, v in s.items()
        ),
        "",
        "| ratio (median of per-round ratios) | value | per round |",
        "|---|---:|---|",
        *(
            f"| step time, {k} | **{v['median']:.2f}** | {', '.join(f'{x:.2f}' for x in v['per_round'])} |"
            for k, v in q.items()
        ),
        f"| real tokens, short / long | {tokens['new']:.2f} | |",
        "",
        "Loss, new vs. old planner: "
        f"|difference| {r['loss_diff']['long']:.1e} (long), {r['loss_diff']['short']:.1e} (short).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
