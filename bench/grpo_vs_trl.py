"""GRPO step throughput: agl end to end vs. TRL's GRPOTrainer, side by side in one invocation.

Workload (both systems): SmolLM2-135M-Instruct, NF4 + LoRA r16 (all linear layers), CPU;
B = 4 GSM8K prompts x G = 8 samples, up to 128 new tokens, temperature 1, lr 1e-5, DAPO loss,
beta 0, mu 1, the same GSM8K reward (correct 1.0, '#### N' format 0.1) and the same prompt pool
(the first 64 train questions, through the same chat template and cot prompt).

  - agl: the real HTTP route, runners, SQLite store and GRPO update (``GRPOTrainer.train_step``).
  - TRL: ``trl.GRPOTrainer`` (an optional ``bench`` extra, never a runtime dependency), given
    the same policy object in two configurations: ``trl`` with agl's compute dtype (bf16
    4-bit matmuls on this CPU) and ``trl-fp32`` with fp32 compute (bitsandbytes' default, the
    setup of the ~75 s/step figure the issue quotes).

Each system runs in its own subprocess (so each has its own peak RSS), one warm-up step and
then ``--steps`` timed steps; the driver alternates the systems for ``--rounds`` rounds so
machine noise hits both alike. The matmul peak (bf16 and fp32 GFLOP/s) is measured first.

    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py            # writes bench/results/grpo_vs_trl.{md,json}
    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --only agl trl --rounds 1 --steps 1
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see harness.py

import argparse
import asyncio
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time

from agl.jobs import peak_rss_mib
from bench.common import RESULTS, ROOT, gsm8k_prompts, load_model, time_method

GFLOP_PER_TOKEN = 0.27  # forward, 2 x 135M parameters; backward counted as 2 x forward
B, G, NEW_TOKENS, LR, POOL = 4, 8, 128, 1e-5, 64


def matmul_peak() -> dict:
    import torch

    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        for _ in range(2):
            a @ b
        best = min(_timed(lambda: a @ b) for _ in range(5))
        out[f"{name}_gflops"] = 2 * 2048**3 / best / 1e9
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- agl worker


def run_agl(steps: int) -> dict:
    from hydra import compose, initialize_config_dir

    from agl.config import register_configs
    from agl.runtime import Runtime
    from agl.trainer import GRPOTrainer

    overrides = [
        "task=gsm8k", "algo=grpo", "progress=false", f"task.max_tokens={NEW_TOKENS}", "task.eval_size=0",
        f"algo.batch_size={B}", f"algo.group_size={G}", f"algo.lr={LR}", "algo.loss_type=dapo", "algo.temperature=1.0",
        "algo.beta=0", "algo.num_iterations=1", "algo.eval_every=0", f"algo.steps={steps + 1}", "algo.micro_batch_size=8",
        "runner.n=32", "algo.drop_zero_std=false",  # the same work as TRL, which updates on every group
    ]
    register_configs()  # the schemas conf/ names
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)

    async def main() -> list[dict]:
        with tempfile.TemporaryDirectory() as run_dir:
            async with Runtime(cfg, run_dir) as rt:
                trainer = GRPOTrainer(rt, cfg)
                trainer.train_rows = gsm8k_prompts("train", POOL)
                trainer.cursor.n_rows = len(trainer.train_rows)
                rows = []
                for step in range(steps + 1):
                    trainer.step = step
                    start = time.perf_counter()
                    m = await trainer.train_step()
                    total = time.perf_counter() - start
                    completion_tokens = m["completion_len_mean"] * m["rollouts"]
                    rows.append({
                        "warmup": step == 0,
                        "step_s": total,
                        "completion_tokens": completion_tokens,
                        "generation_s": m["time_rollout_s"],
                        "logprob_s": m.get("old_logprob_s", 0.0) + m.get("ref_s", 0.0) + m.get("forward_s", 0.0),
                        "backward_optimizer_s": m.get("backward_s", 0.0) + m.get("optimizer_s", 0.0),
                        "overhead_s": total - m["time_rollout_s"] - m.get("forward_s", 0.0) - m.get("backward_s", 0.0) - m.get("optimizer_s", 0.0),
                        "prompt_tokens": m.get("prompt_tokens", 0),
                        "train_tokens": m.get("train_input_tokens", 0),
                        "reward_mean": m["reward_mean"],
                    })
                return rows

    return {"steps": asyncio.run(main())}


# ----------------------------------------------------------------------------- TRL worker


def run_trl(steps: int, compute_dtype: str = "auto") -> dict:
    from collections import defaultdict

    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tasks.gsm8k.scoring import reward as gsm8k_reward

    policy = load_model("smollm2", compute_dtype)  # the same NF4 base + fresh LoRA r16 as agl's
    pool = gsm8k_prompts("train", POOL)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt_text"]}], "gold": r["gold"]} for r in pool])

    def reward_fn(completions, gold, **_):
        return [gsm8k_reward(c[0]["content"] if isinstance(c, list) else c, g) for c, g in zip(completions, gold)]

    timings: dict[str, float] = defaultdict(float)
    rows: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timings.clear()
            timings["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            total = time.perf_counter() - timings["start"]
            rows.append({
                "warmup": not rows,
                "step_s": total,
                "completion_tokens": timings["completion_tokens"],
                "generation_s": timings["generate"],
                "logprob_s": timings["logps"],
                "backward_optimizer_s": timings["training_step"] - timings["prepare_inputs"] - timings["compute_loss"],
                "overhead_s": total - timings["generate"] - timings["logps"] - (timings["training_step"] - timings["prepare_inputs"] - timings["compute_loss"]),
                "reward_mean": timings.get("reward_mean", 0.0),
            })

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=B * G, gradient_accumulation_steps=1, num_generations=G,
            max_completion_length=NEW_TOKENS, learning_rate=LR, max_steps=steps + 1, temperature=1.0, beta=0.0,
            num_iterations=1, loss_type="dapo", logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            bf16=False, seed=0, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=policy.model, reward_funcs=reward_fn, args=args, train_dataset=dataset, processing_class=policy.tokenizer, callbacks=[StepTimer()])
        time_method(trainer, "_generate", "generate", timings)
        time_method(trainer, "_get_per_token_logps_and_entropies", "logps", timings)
        time_method(trainer, "training_step", "training_step", timings)
        time_method(trainer, "compute_loss", "compute_loss", timings)
        time_method(trainer, "_prepare_inputs", "prepare_inputs", timings)
        original = trainer._generate

        def counting_generate(prompts):
            result = original(prompts)
            completion_ids = result[1] if isinstance(result, tuple) else None
            if completion_ids is not None:
                timings["completion_tokens"] += sum(len(c) for c in completion_ids)
            return result

        trainer._generate = counting_generate
        trainer.train()
    return {"steps": rows}


# ----------------------------------------------------------------------------- driver


SYSTEMS = {
    "agl": lambda steps: run_agl(steps),
    "trl": lambda steps: run_trl(steps, "auto"),  # TRL on agl's policy: bf16 4-bit matmuls here
    "trl-fp32": lambda steps: run_trl(steps, "float32"),  # NF4 weights, fp32 compute (bitsandbytes' default)
}


def worker(system: str, steps: int) -> None:
    result = SYSTEMS[system](steps)
    result["peak_rss_mib"] = peak_rss_mib()
    print("RESULT " + json.dumps(result), flush=True)


def launch(system: str, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--worker", system, "--steps", str(steps)], cwd=ROOT, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{system} worker failed:\n{proc.stderr[-4000:]}")


def summarize(runs: list[dict]) -> dict:
    steps = [s for run in runs for s in run["steps"] if not s["warmup"]]
    med = lambda key: statistics.median(s.get(key, 0.0) for s in steps)  # noqa: E731
    step_s = med("step_s")
    return {
        "steps_timed": len(steps),
        "step_s": step_s,
        "completion_tok_s": statistics.median(s["completion_tokens"] / s["step_s"] for s in steps),
        "generation_s": med("generation_s"),
        "logprob_s": med("logprob_s"),
        "backward_optimizer_s": med("backward_optimizer_s"),
        "overhead_s": med("overhead_s"),
        "completion_tokens": med("completion_tokens"),
        "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
        "flops_per_step_gflop": _step_gflop(steps),
    }


def _step_gflop(steps: list[dict]) -> float:
    """Generation (prompt + completion tokens, forward) + update (forward + 2x backward)."""
    completion = statistics.median(s["completion_tokens"] for s in steps)
    prompt = statistics.median(s.get("prompt_tokens", 0) for s in steps) or B * 110  # ~110-token GSM8K prompts
    train = statistics.median(s.get("train_tokens", 0) for s in steps) or (B * G * (prompt / B) + completion)
    return GFLOP_PER_TOKEN * (prompt + completion) + 3 * GFLOP_PER_TOKEN * train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--only", nargs="+", choices=list(SYSTEMS), help="run only these systems")
    parser.add_argument("--worker", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)

    peak = matmul_peak()
    systems = args.only or list(SYSTEMS)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for round_ in range(args.rounds):
        for system in systems if round_ % 2 == 0 else systems[::-1]:
            print(f"round {round_ + 1}/{args.rounds}: {system} ...", flush=True)
            runs[system].append(launch(system, args.steps))
    summary = {s: summarize(r) for s, r in runs.items()}
    for s in summary.values():
        s["achieved_gflops"] = s["flops_per_step_gflop"] / s["step_s"]
        s["fraction_of_bf16_peak"] = s["achieved_gflops"] / peak["bf16_gflops"]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "workload": {"B": B, "G": G, "new_tokens": NEW_TOKENS, "lr": LR}, "matmul_peak": peak, "summary": summary, "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpo_vs_trl.json").write_text(json.dumps(result, indent=1))
    (RESULTS / "grpo_vs_trl.md").write_text(render(result))
    print(render(result))


def render(result: dict) -> str:
    summary, peak = result["summary"], result["matmul_peak"]
    cols = list(summary)
    lines = [
        "# GRPO step: agl vs TRL GRPOTrainer",
        "",
        f"{result['date']}. SmolLM2-135M-Instruct NF4 + LoRA r16, CPU (2 cores). B={B} prompts x G={G}, <= {NEW_TOKENS} new tokens, lr {LR}, DAPO, beta 0, mu 1. "
        f"Median over timed steps (after a warm-up step per process), systems alternated. Matmul peak measured here: "
        f"bf16 {peak['bf16_gflops']:.0f} GFLOP/s, fp32 {peak['fp32_gflops']:.0f} GFLOP/s. Written by `bench/grpo_vs_trl.py`.",
        "",
        "| | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    rows = [
        ("seconds / step", "step_s", "{:.1f}"),
        ("completion tokens / s", "completion_tok_s", "{:.1f}"),
        ("generation s", "generation_s", "{:.1f}"),
        ("logprob / reference passes s", "logprob_s", "{:.1f}"),
        ("backward + optimizer s", "backward_optimizer_s", "{:.1f}"),
        ("overhead s", "overhead_s", "{:.1f}"),
        ("completion tokens / step", "completion_tokens", "{:.0f}"),
        ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
        ("GFLOP / step (est.)", "flops_per_step_gflop", "{:.0f}"),
        ("achieved GFLOP/s", "achieved_gflops", "{:.1f}"),
        ("fraction of bf16 matmul peak", "fraction_of_bf16_peak", "{:.3f}"),
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(summary[c][key]) for c in cols) + " |")
    for trl in ("trl", "trl-fp32"):
        if {"agl", trl} <= set(summary):
            ratio = summary[trl]["step_s"] / summary["agl"]["step_s"]
            lines += ["", f"**agl steps/s ÷ {trl} steps/s = {ratio:.2f}×**"]
    lines += ["", "`trl`: TRL's GRPOTrainer on agl's policy object (the same NF4 base and fresh LoRA, bf16 4-bit matmuls on this "
              "CPU, bitsandbytes' CPU repacking off). `trl-fp32`: the same, with fp32 compute, bitsandbytes' default."]
    lines += ["", "For agl, generation is the rollout phase (agents calling the route, including their HTTP and store work); "
              "its update-side forward passes are counted under logprob passes. TRL's compute_loss forward is counted the same way."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
