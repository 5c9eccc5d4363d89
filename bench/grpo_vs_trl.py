"""GRPO step throughput: agl end to end vs. TRL's GRPOTrainer, side by side in one invocation.

Workload (both systems): SmolLM2-135M-Instruct, NF4 + LoRA r16 (all linear layers), CPU;
B = 4 GSM8K prompts x G = 8 samples, up to ``--new-tokens`` new tokens (default 128), temperature 1,
lr 1e-5, DAPO loss (clip 0.2 / 0.28), beta 0, mu 1, the same GSM8K reward (correct 1.0, '#### N'
format 0.1), the same prompt pool (the first 64 train questions, through the same chat template and
cot prompt), and the same activation checkpointing setting (on by default in both: agl's
``algo.gradient_checkpointing`` and TRL's ``gradient_checkpointing``, alias ``activation_checkpointing``).

  - agl: the real HTTP route, runners, SQLite store and GRPO update (``GRPOTrainer.train_step``).
  - TRL: ``trl.GRPOTrainer`` (an optional ``bench`` extra, never a runtime dependency; written
    against TRL 1.16), given the same policy object in up to two configurations: ``trl`` with agl's
    compute dtype (``model.compute_dtype=auto``, resolved by ``agl.policy.load.resolve_compute_dtype``) and
    ``trl-fp32`` with fp32 compute (bitsandbytes' default). Where agl's dtype resolves to float32
    (a CPU without native bf16) the two are the same run, so only ``trl`` runs, labelled fp32.

Each system runs in its own subprocess (so each has its own peak RSS and malloc), one warm-up step and
then ``--steps`` timed steps; the driver alternates the systems for ``--rounds`` rounds so
machine noise hits both alike. The matmul peak (bf16 and fp32 GFLOP/s) is measured first; where
bf16 is not native the bf16 probe uses a small matrix (it runs at well under 1 GFLOP/s there).
agl's worker sets up memory as ``harness.py`` does: ``AGL_ALLOCATOR``'s malloc (default ``auto``:
tcmalloc or jemalloc where installed), else glibc with its mmap threshold pinned, and capped kernel
caches (agl/memory.py). TRL's runs on ``--trl-malloc`` (default ``glibc``, untouched: as TRL runs).
Results go to ``bench/results/grpo_vs_trl_<new tokens>[_trl_<malloc>][_no_checkpointing][_<label>].{md,json}``.

On a GPU (``--device cuda``; bench/gpu_bench.py runs it so at each model shape): both systems on the same CUDA
device, TRL with bf16 mixed precision where the compute dtype is bf16 (its QLoRA recipe), peak VRAM
(``torch.cuda.max_memory_allocated``) per system; ``--model`` names a conf/model yaml (``shape_qwen25_15b``:
random weights in Qwen2.5-1.5B's shape) and ``--tokenizer`` the folder its tokenizer comes from
(bench/export_tokenizer.py). The CPU-only memory setup (malloc, kernel caches) is left out there, as
``harness.py`` leaves it out.

    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --new-tokens 128
    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --new-tokens 256
    PYTHONPATH=. .venv/bin/python bench/grpo_vs_trl.py --rounds 1 --steps 1 --new-tokens 16   # a smoke test
    PYTHONPATH=. python3 bench/grpo_vs_trl.py --device cuda --model shape_qwen25_15b --tokenizer .gpu/tokenizer \
        --new-tokens 256 --rounds 1 --steps 1 --only agl trl
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

from agl.config import to_typed
from agl.memory import (
    ALLOCATORS,
    active_allocator,
    cap_kernel_caches,
    peak_rss_mib,
    preload_allocator,
    release_freed_memory,
)
from bench.common import RESULTS, ROOT, gsm8k_prompts, load_model, matmul_probe, time_method

GFLOP_PER_TOKEN = 0.27  # forward, 2 x 135M parameters; backward counted as 2 x forward
B, G, LR, POOL = 4, 8, 1e-5, 64
EPSILON, EPSILON_HIGH = (
    0.2,
    0.28,
)  # agl's GRPOConfig defaults; given to TRL too (whose epsilon_high defaults to epsilon)

# system -> the model.compute_dtype it is run with ("auto": agl's resolution)
SYSTEMS = {"agl": "auto", "trl": "auto", "trl-fp32": "float32"}


@dataclasses.dataclass(frozen=True)
class Target:
    """What both systems run on: a conf/model yaml, a device, and the folder a random-weight model's tokenizer
    comes from (None: the embedded model's)."""

    model: str = "smollm2"
    device: str = "cpu"
    tokenizer: str | None = None

    def arguments(self) -> list[str]:
        return ["--model", self.model, "--device", self.device] + (
            ["--tokenizer", self.tokenizer] if self.tokenizer else []
        )


def resolved_dtype(name: str, device: str = "cpu") -> str:
    """``model.compute_dtype`` as agl resolves it on ``device``: ``float32``, ``bfloat16`` or ``float16``."""
    import torch

    from agl.policy.load import resolve_compute_dtype

    return str(resolve_compute_dtype(name, torch.device(device))).removeprefix("torch.")


def matmul_peak(bf16_native: bool, device: str = "cpu") -> dict:
    """Best-of-5 GFLOP/s of a square matmul per dtype. bf16 without native support runs at well
    under 1 GFLOP/s, so there a 256x256 probe (a fraction of a second) stands in for 2048x2048; a GPU
    gets 8192x8192 (a 2048 product would not fill it)."""
    import torch

    out = {}
    big = 8192 if device != "cpu" else 2048
    for name, dtype, n in (("bf16", torch.bfloat16, big if bf16_native else 256), ("fp32", torch.float32, big)):
        out[f"{name}_gflops"] = matmul_probe(dtype, n, warmup=2, device=device)
        out[f"{name}_probe_n"] = n
    out["bf16_native"] = bf16_native
    return out


# ----------------------------------------------------------------------------- agl worker


def run_agl(steps: int, new_tokens: int, gradient_checkpointing: bool, target: Target = Target()) -> dict:
    from hydra import compose, initialize_config_dir

    from agl.config import register_configs
    from agl.runtime import Runtime
    from agl.train.grpo_trainer import GRPOTrainer

    overrides = [
        f"model={target.model}",
        f"device={target.device}",
        *([f"model.tokenizer={target.tokenizer}"] if target.tokenizer else []),
        "task=gsm8k",
        "algo=grpo",
        "progress=false",
        f"task.max_tokens={new_tokens}",
        "task.eval_size=0",
        f"algo.batch_size={B}",
        f"algo.group_size={G}",
        f"algo.lr={LR}",
        "algo.loss.type=dapo",
        "algo.temperature=1.0",
        f"algo.loss.epsilon={EPSILON}",
        f"algo.loss.epsilon_high={EPSILON_HIGH}",
        "algo.beta=0",
        "algo.num_iterations=1",
        "algo.eval_every=0",
        f"algo.steps={steps + 1}",  # micro-batches: agl's default token budget
        f"algo.gradient_checkpointing={str(gradient_checkpointing).lower()}",
        "algo.warmup.steps=0",  # gsm8k's recipe has an SFT warm-up; train_step is called directly, so build none
        "runner.n=32",
        "algo.drop_zero_std=false",  # the same work as TRL, which updates on every group
    ]
    register_configs()  # the schemas conf/ names
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)

    async def main() -> list[dict]:
        with tempfile.TemporaryDirectory() as run_dir:
            async with Runtime.of(to_typed(cfg), run_dir) as rt:
                trainer = GRPOTrainer(rt, to_typed(cfg).algo)
                trainer.train_rows = gsm8k_prompts("train", POOL)
                trainer.cursor.n_rows = len(trainer.train_rows)
                rows = []
                for step in range(steps + 1):
                    trainer.step = step
                    start = time.perf_counter()
                    m = await trainer.train_step()
                    total = time.perf_counter() - start
                    logprob = m.get("old_logprob_s", 0.0) + m.get("ref_s", 0.0) + m.get("forward_s", 0.0)
                    backward_optimizer = m.get("backward_s", 0.0) + m.get("optimizer_s", 0.0)
                    rows.append(
                        {
                            "warmup": step == 0,
                            "step_s": total,
                            "completion_tokens": m["completion_len_mean"] * m["rollouts"],
                            "generation_s": m["time_rollout_s"],
                            "logprob_s": logprob,
                            "backward_optimizer_s": backward_optimizer,
                            "overhead_s": total - m["time_rollout_s"] - logprob - backward_optimizer,
                            "prompt_tokens": m.get(
                                "prompt_tokens", 0
                            ),  # prefilled by the engine (a group's prompt once)
                            "train_tokens": m.get(
                                "train_input_tokens", 0
                            ),  # run through the update (a group's prompt once)
                            "reward_mean": m["reward_mean"],
                            "logprob_diff_abs": m.get("logprob_diff_abs", 0.0),
                        }
                    )
                return rows

    return {"steps": asyncio.run(main())}


# ----------------------------------------------------------------------------- TRL worker


def run_trl(
    steps: int, new_tokens: int, gradient_checkpointing: bool, compute_dtype: str, target: Target = Target()
) -> dict:
    """TRL's GRPOTrainer on agl's policy object. Phases, by wrapping TRL 1.16's methods:
    generation = ``_generate`` (tokenize, ``model.generate``, decode); logprob passes = ``compute_loss``
    (its forward through ``_get_per_token_logps_and_entropies``, and the loss) plus any old-logprob pass
    made while preparing inputs (none at mu=1); backward + optimizer = ``training_step`` minus
    ``_prepare_inputs`` and ``compute_loss``, plus the time from ``training_step``'s return to the end of
    the step (grad clipping, ``optimizer.step``, scheduler, ``zero_grad``). The rest (reward scoring,
    advantages, padding) is overhead."""
    from collections import defaultdict

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tasks.gsm8k.scoring import reward as gsm8k_reward

    # the same NF4 base + fresh LoRA r16 as agl's
    policy = load_model(target.model, compute_dtype, target.device, target.tokenizer)
    pool = gsm8k_prompts("train", POOL)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt_text"]}], "gold": r["gold"]} for r in pool]
    )

    def reward_fn(completions, gold, **_):
        return [gsm8k_reward(c[0]["content"] if isinstance(c, list) else c, g) for c, g in zip(completions, gold)]

    timings: dict[str, float] = defaultdict(float)
    rows: list[dict] = []
    holder: dict = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timings.clear()
            timings["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            end = time.perf_counter()
            total = end - timings["start"]
            logprob = timings["compute_loss"] + timings["logps_outside_loss"]
            backward_optimizer = (timings["training_step"] - timings["prepare_inputs"] - timings["compute_loss"]) + (
                end - timings["training_step_end"]
            )
            rewards = holder["trainer"]._metrics["train"].get("reward") or [0.0]
            rows.append(
                {
                    "warmup": not rows,
                    "step_s": total,
                    "completion_tokens": timings["completion_tokens"],
                    "generation_s": timings["generate"],
                    "logprob_s": logprob,
                    "backward_optimizer_s": backward_optimizer,
                    "overhead_s": total - timings["generate"] - logprob - backward_optimizer,
                    "prompt_tokens": timings["prompt_tokens"],  # prefilled by model.generate: every row's prompt
                    "train_tokens": timings["train_tokens"],  # unpadded prompt + completion tokens of every row
                    "reward_mean": rewards[-1],
                }
            )

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=B * G,
            gradient_accumulation_steps=1,
            num_generations=G,
            max_completion_length=new_tokens,
            learning_rate=LR,
            max_steps=steps + 1,
            temperature=1.0,
            beta=0.0,
            num_iterations=1,
            loss_type="dapo",
            epsilon=EPSILON,
            epsilon_high=EPSILON_HIGH,
            # transformers 5's name; TRL's default (gradient_checkpointing) is on
            activation_checkpointing=gradient_checkpointing,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=target.device == "cpu",
            bf16=target.device != "cpu" and policy.compute_dtype == torch.bfloat16,  # the QLoRA recipe on a GPU
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=policy.model,
            reward_funcs=reward_fn,
            args=args,
            train_dataset=dataset,
            processing_class=policy.tokenizer,
            callbacks=[StepTimer()],
        )
        holder["trainer"] = trainer
        # TRL casts a quantized model's trainable (LoRA) weights to bf16, the QLoRA recipe. agl trains them in
        # fp32; with fp32 compute, bf16 LoRA weights would put bf16 matmuls back into every layer (slow where
        # bf16 is not native), so they go back to fp32 here, before train() builds the optimizer.
        if policy.compute_dtype == torch.float32:
            for p in trainer.model.parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    p.data = p.data.float()
        adapter_dtypes = sorted(
            {str(p.dtype).removeprefix("torch.") for p in trainer.model.parameters() if p.requires_grad}
        )

        time_method(trainer, "_generate", "generate", timings)
        time_method(trainer, "_prepare_inputs", "prepare_inputs", timings)
        time_method(trainer, "compute_loss", "compute_loss", timings)
        in_loss = [False]
        compute_loss, logps, training_step, generate = (
            trainer.compute_loss,
            trainer._get_per_token_logps_and_entropies,
            trainer.training_step,
            trainer._generate,
        )

        def flagged_compute_loss(*a, **kw):
            in_loss[0] = True
            try:
                return compute_loss(*a, **kw)
            finally:
                in_loss[0] = False

        def timed_logps(*a, **kw):
            start = time.perf_counter()
            try:
                return logps(*a, **kw)
            finally:
                if not in_loss[0]:
                    timings["logps_outside_loss"] += time.perf_counter() - start

        def timed_training_step(*a, **kw):
            start = time.perf_counter()
            try:
                return training_step(*a, **kw)
            finally:
                timings["training_step_end"] = time.perf_counter()
                timings["training_step"] += timings["training_step_end"] - start

        def counting_generate(prompts):
            result = generate(
                prompts
            )  # (prompt_ids, completion_ids, tool_mask, completions, logprobs, ...) in TRL 1.16
            prompt_ids, completion_ids = result[0], result[1]
            timings["completion_tokens"] += sum(len(c) for c in completion_ids)
            timings["prompt_tokens"] += sum(len(p) for p in prompt_ids)
            timings["train_tokens"] += sum(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
            return result

        trainer.compute_loss = flagged_compute_loss
        trainer._get_per_token_logps_and_entropies = timed_logps
        trainer.training_step = timed_training_step
        trainer._generate = counting_generate
        trainer.train()
    return {"steps": rows, "adapter_dtype": "/".join(adapter_dtypes)}


# ----------------------------------------------------------------------------- driver


def worker(system: str, steps: int, new_tokens: int, gradient_checkpointing: bool, target: Target) -> None:
    on_cpu = target.device == "cpu"
    if on_cpu:  # the CPU-only memory measures, as harness.py takes them (agl/memory.py); not on a GPU
        preload_allocator()  # the driver set AGL_ALLOCATOR for this system; runs this worker again under it, once
    if system == "agl":
        if on_cpu:
            release_freed_memory()  # as harness.py does (a no-op under tcmalloc or jemalloc)
            cap_kernel_caches()
        result = run_agl(steps, new_tokens, gradient_checkpointing, target)
    else:
        result = run_trl(steps, new_tokens, gradient_checkpointing, SYSTEMS[system], target)
    result["peak_rss_mib"] = peak_rss_mib()
    result["malloc"] = active_allocator()
    if not on_cpu:
        import torch

        result["peak_vram_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result), flush=True)


def launch(
    system: str,
    steps: int,
    new_tokens: int,
    gradient_checkpointing: bool,
    trl_malloc: str,
    target: Target = Target(),
    timeout: float | None = None,
) -> dict:
    malloc = os.environ.get("AGL_ALLOCATOR", "auto") if system == "agl" else trl_malloc
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGL_ALLOCATOR": malloc}
    command = [sys.executable, __file__, "--worker", system, "--steps", str(steps), "--new-tokens", str(new_tokens)]
    command.append("--gradient-checkpointing" if gradient_checkpointing else "--no-gradient-checkpointing")
    command += target.arguments()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{system} worker failed:\n{proc.stderr[-4000:]}")


def pick_systems(asked: list[str] | None, dtypes: dict[str, str]) -> tuple[list[str], str | None]:
    """The systems to run, and a note when ``trl-fp32`` is dropped because ``trl`` already computes in fp32."""
    systems = asked or list(SYSTEMS)
    if "trl" in systems and "trl-fp32" in systems and dtypes["trl"] == dtypes["trl-fp32"]:
        note = (
            f"`trl-fp32` was not run: agl's model.compute_dtype=auto resolves to {dtypes['trl']} on this CPU "
            "(no native bf16), so `trl` (TRL on agl's compute dtype) already is the fp32 configuration."
        )
        return [s for s in systems if s != "trl-fp32"], note
    return systems, None


def summarize(runs: list[dict], peak: dict, dtype: str) -> dict:
    steps = [s for run in runs for s in run["steps"] if not s["warmup"]]
    med = lambda key: statistics.median(s.get(key, 0.0) for s in steps)  # noqa: E731
    step_s = med("step_s")
    flops = _step_gflop(steps)
    peak_gflops = peak["bf16_gflops" if dtype == "bfloat16" else "fp32_gflops"]
    return {
        "compute_dtype": dtype,
        "adapter_dtype": runs[0].get("adapter_dtype", "float32"),
        "steps_timed": len(steps),
        "step_s": step_s,
        "completion_tok_s": statistics.median(s["completion_tokens"] / s["step_s"] for s in steps),
        "generation_s": med("generation_s"),
        "logprob_s": med("logprob_s"),
        "backward_optimizer_s": med("backward_optimizer_s"),
        "overhead_s": med("overhead_s"),
        "completion_tokens": med("completion_tokens"),
        "reward_mean": med("reward_mean"),
        "logprob_diff_abs": med("logprob_diff_abs"),
        "peak_rss_mib": max(run["peak_rss_mib"] for run in runs),
        "peak_vram_mib": max(run.get("peak_vram_mib", 0.0) for run in runs),
        "malloc": "/".join(sorted({run.get("malloc", "?") for run in runs})),
        "flops_per_step_gflop": flops,
        "achieved_gflops": flops / step_s,
        "peak_gflops": peak_gflops,
        "fraction_of_peak": flops / step_s / peak_gflops,  # of the matmul peak of the dtype it computes in
    }


def _step_gflop(steps: list[dict]) -> float:
    """Generation (prompt + completion tokens, forward) + update (forward + 2x backward), on the tokens each
    system ran (unpadded): agl prefills and trains a group's shared prompt once, TRL once per row."""
    completion = statistics.median(s["completion_tokens"] for s in steps)
    prompt = statistics.median(s.get("prompt_tokens", 0) for s in steps) or B * 110  # ~110-token GSM8K prompts
    train = statistics.median(s.get("train_tokens", 0) for s in steps) or (G * prompt + completion)
    return GFLOP_PER_TOKEN * (prompt + completion) + 3 * GFLOP_PER_TOKEN * train


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--new-tokens", type=int, default=128, help="max new tokens per completion, both systems")
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation checkpointing of the decoder layers in both systems (default on: agl's and TRL's default)",
    )
    parser.add_argument("--only", nargs="+", choices=list(SYSTEMS), help="run only these systems")
    parser.add_argument(
        "--label", help="a suffix for the result files (e.g. the machine), so a run does not replace another's"
    )
    parser.add_argument(
        "--trl-malloc",
        default="glibc",
        choices=["glibc", "auto", *ALLOCATORS],
        help=(
            "TRL's malloc (AGL_ALLOCATOR's names; default glibc, as TRL runs). agl's is AGL_ALLOCATOR's (default auto)"
        ),
    )
    parser.add_argument("--model", default="smollm2", help="a conf/model yaml: smollm2, shape_qwen25_15b, ...")
    parser.add_argument("--device", default="cpu", help="cpu or cuda: both systems run there")
    parser.add_argument("--tokenizer", help="model.tokenizer: the folder a random-weight model's tokenizer is in")
    parser.add_argument("--worker", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    target = Target(args.model, args.device, args.tokenizer)
    if args.worker:
        return worker(args.worker, args.steps, args.new_tokens, args.gradient_checkpointing, target)

    dtypes = {system: resolved_dtype(name, args.device) for system, name in SYSTEMS.items()}
    systems, note = pick_systems(args.only, dtypes)
    peak = matmul_peak(bf16_native=resolved_dtype("auto", args.device) == "bfloat16", device=args.device)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for round_ in range(args.rounds):
        for system in systems if round_ % 2 == 0 else systems[::-1]:
            print(f"round {round_ + 1}/{args.rounds}: {system} ...", flush=True)
            runs[system].append(
                launch(system, args.steps, args.new_tokens, args.gradient_checkpointing, args.trl_malloc, target)
            )
    summary = {s: summarize(r, peak, dtypes[s]) for s, r in runs.items()}
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "target": dataclasses.asdict(target),
        "command": shlex.join(["PYTHONPATH=.", ".venv/bin/python", "bench/grpo_vs_trl.py", *sys.argv[1:]]),
        "workload": {
            "B": B,
            "G": G,
            "new_tokens": args.new_tokens,
            "lr": LR,
            "epsilon": EPSILON,
            "epsilon_high": EPSILON_HIGH,
            "gradient_checkpointing": args.gradient_checkpointing,
        },
        "versions": {p: _version(p) for p in ("trl", "transformers", "torch", "peft", "bitsandbytes")},
        "compute_dtypes": dtypes,
        "note": note,
        "matmul_peak": peak,
        "summary": summary,
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"grpo_vs_trl_{args.new_tokens}" + ("" if args.trl_malloc == "glibc" else f"_trl_{args.trl_malloc}")
    stem += ("" if args.gradient_checkpointing else "_no_checkpointing") + (f"_{args.label}" if args.label else "")
    stem += ("" if args.model == "smollm2" else f"_{args.model}") + ("" if args.device == "cpu" else f"_{args.device}")
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{stem}.md").write_text(render(result))
    print(render(result))


def _workload_model(target: dict | None) -> str:
    model = (target or {}).get("model", "smollm2")
    return "SmolLM2-135M-Instruct" if model == "smollm2" else f"`model={model}` (random weights)"


def _machine(target: dict | None) -> str:
    device = (target or {}).get("device", "cpu")
    if device == "cpu":
        return "CPU (2 cores)"
    import torch

    return torch.cuda.get_device_name(device)


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def render(result: dict) -> str:
    summary, peak, work = result["summary"], result["matmul_peak"], result["workload"]
    cols = list(summary)
    bf16_probe = f"bf16 {peak['bf16_gflops']:.1f} GFLOP/s" + (
        "" if peak["bf16_native"] else f" (not native here; {peak['bf16_probe_n']}² probe)"
    )
    checkpointing = (
        "on in both (agl `algo.gradient_checkpointing=true`, "
        "TRL `gradient_checkpointing`/`activation_checkpointing=True`, TRL 1.16's default)"
        if work["gradient_checkpointing"]
        else "off in both (agl `algo.gradient_checkpointing=false`, TRL `activation_checkpointing=False`)"
    )
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines = [
        f"# GRPO step: agl vs TRL GRPOTrainer, <= {work['new_tokens']} new tokens",
        "",
        f"{result['date']}. {_workload_model(result.get('target'))} NF4 + LoRA r16, {_machine(result.get('target'))}. "
        f"B={work['B']} prompts x G={work['G']}, "
        f"<= {work['new_tokens']} new tokens, lr {work['lr']}, "
        f"DAPO (clip {work['epsilon']} / {work['epsilon_high']}), beta 0, mu 1. "
        f"Activation checkpointing: {checkpointing}. "
        f"Median over timed steps (after a warm-up step per process), systems alternated. Matmul peak measured here: "
        f"{bf16_probe}, fp32 {peak['fp32_gflops']:.0f} GFLOP/s. {versions}. Written by `bench/grpo_vs_trl.py`:",
        "",
        f"    {result['command']}",
        "",
        "| | " + " | ".join(f"{c} ({_short(summary[c]['compute_dtype'])})" for c in cols) + " |",
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
        ("reward mean", "reward_mean", "{:.3f}"),
        ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
        ("peak VRAM MiB", "peak_vram_mib", "{:.0f}"),
        ("malloc", "malloc", "{}"),
        ("GFLOP / step (est.)", "flops_per_step_gflop", "{:.0f}"),
        ("achieved GFLOP/s", "achieved_gflops", "{:.1f}"),
        ("fraction of matmul peak (its compute dtype)", "fraction_of_peak", "{:.3f}"),
        ("LoRA weights dtype", "adapter_dtype", "{}"),
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(summary[c][key]) for c in cols) + " |")
    for trl in ("trl", "trl-fp32"):
        if {"agl", trl} <= set(summary):
            ratio = summary[trl]["step_s"] / summary["agl"]["step_s"]
            lines += ["", f"**agl steps/s ÷ {trl} steps/s = {ratio:.2f}×**"]
    lines += [
        "",
        "`trl`: TRL's GRPOTrainer on agl's policy object (the same NF4 base and fresh LoRA) with agl's compute dtype "
        "(model.compute_dtype=auto: bf16 where the CPU has it natively, else fp32; bitsandbytes' CPU repacking off). "
        "`trl-fp32`: the same with fp32 compute, bitsandbytes' default. "
        "Memory: agl's worker as `harness.py` sets it up "
        "(AGL_ALLOCATOR's malloc, default tcmalloc or jemalloc where installed, else glibc with its mmap threshold "
        "pinned; capped kernel caches); TRL's on `--trl-malloc` (default glibc, untouched). Row 'malloc'.",
    ]
    if result.get("note"):
        lines += ["", result["note"]]
    lines += [
        "",
        "TRL 1.16 casts a quantized model's LoRA weights to bf16 (the QLoRA recipe); where TRL computes in fp32 the "
        "bench casts them back to fp32, as agl trains them (row 'LoRA weights dtype').",
    ]
    lines += [
        "",
        "For agl, generation is the rollout phase (agents calling the route, including their HTTP and store work); "
        "its update-side forward passes are counted under logprob passes. TRL's generation is `_generate` "
        "(`model.generate` on the whole batch); its `compute_loss` forward is counted under logprob passes; its "
        "backward + optimizer is `training_step` less input preparation and `compute_loss`, plus grad clipping "
        "and `optimizer.step`; reward scoring and advantages are overhead. GFLOP / step counts the tokens each "
        "system ran (unpadded): agl prefills and trains a group's shared prompt once, TRL once per row. The matmul "
        "peak of the dtype each system computes in is the denominator of its fraction.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
