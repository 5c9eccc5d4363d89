"""Where resident memory goes when freed tensors stay in malloc's heaps, and what pinning
glibc's mmap threshold (agl/memory.py, set by harness.py) changes, side by side.

    PYTHONPATH=. .venv/bin/python bench/memory.py [--prompts 128] [--rounds 2]

Workload: the embedded policy's engine decodes ``--prompts`` GSM8K test prompts, 256 greedy
tokens each, 64 at a time (the eval of a GRPO job, without HTTP). Each variant runs in a fresh
process (a process's peak RSS cannot be reset); variants alternate within each round. Reported
per variant: RSS after loading the model, peak RSS, RSS at the end, and tokens/s (the ratio is
the figure to quote: this shared machine's speed moves). Writes bench/results/memory.{md,json}.

``--phases`` (``--prompts`` 64, ``--batch`` 64): where the default job's memory goes, phase by
phase, in one process per variant (``PHASE_VARIANTS``: "before" = the update as it was, "after" =
today's defaults): load the policy, build the engine's merged sampler weights, an eval-like greedy
decode, one SFT warm-up step, one GRPO step's rollouts and its update. A thread samples RSS from
/proc/self/statm every 10 ms; each phase reports RSS at its start, its peak and at its end, with
analytic sizes (weights, KV cache, optimizer state, what autograd saved for backward). Writes
bench/results/memory_phases.{md,json}. ~10 min per variant on this machine, loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys

from agl.memory import ALLOCATORS, find_allocator
from bench.common import RESULTS, ROOT

VARIANTS = {"default malloc": {"AGL_BENCH_PIN": "0"}, "mmap threshold pinned at 1 MiB": {"AGL_BENCH_PIN": "1"}}


def child(prompts: int) -> dict:
    """One variant's measurement, in this (fresh) process."""
    import resource

    if os.environ.get("AGL_BENCH_PIN") == "1":
        from agl.memory import release_freed_memory

        assert release_freed_memory()
    import time

    import psutil

    from agl.policy.engine import Engine, SamplingParams
    from bench.common import gsm8k_prompts, load_model

    policy = load_model()
    loaded = psutil.Process().memory_info().rss
    ids = [policy.render_chat([{"role": "user", "content": r["prompt_text"]}]) for r in gsm8k_prompts("test", prompts)]

    async def run() -> tuple[int, float]:
        engine = Engine(policy, max_batch_size=64)
        await engine.start()
        gate = asyncio.Semaphore(64)

        async def one(p: list[int]) -> int:
            async with gate:
                seq = engine.submit(p, SamplingParams(max_tokens=256, temperature=0.0))[0]
                return len((await seq.wait()).token_ids)

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(p) for p in ids)))
        elapsed = time.perf_counter() - start
        await engine.stop()
        return tokens, elapsed

    tokens, elapsed = asyncio.run(run())
    mib = 2**20
    return {
        "loaded_mib": loaded / mib,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "end_mib": psutil.Process().memory_info().rss / mib,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
    }


# ----------------------------------------------------------------------------- phases of the default job

PHASE_VARIANTS: dict[str, dict] = {
    # name -> {"grpo": GRPOConfig overrides, "sft": SFTConfig overrides, "trim": malloc_trim(0) after each phase (as the
    # trainers now do after an update), "head_chunk_bytes": agl.train.logprobs.CHUNK_BYTES (1 << 62: the whole [N, V]
    # at once, as before), "update_mmap_threshold": agl.memory.UPDATE_MMAP_THRESHOLD_BYTES (1 << 20: updates take their
    # blocks under 1 MiB from heaps, as before)}
    "before": {
        "grpo": {"gradient_checkpointing": False},
        "sft": {"gradient_checkpointing": False},
        "trim": False,
        "head_chunk_bytes": 1 << 62,
        "update_mmap_threshold": 1 << 20,
    },
    "update from heaps": {"grpo": {}, "sft": {}, "trim": True, "update_mmap_threshold": 1 << 20},
    "after": {"grpo": {}, "sft": {}, "trim": True},
    # Allocators. "pin": False leaves glibc's mmap threshold to glibc (dynamic), as without harness.py; "preload": a
    # malloc loaded in glibc's place (LD_PRELOAD, the library found by --jemalloc / --tcmalloc), with "env" for its
    # options.
    "glibc unpinned": {"grpo": {}, "sft": {}, "trim": True, "pin": False},
    "jemalloc": {"grpo": {}, "sft": {}, "trim": True, "pin": False, "preload": "jemalloc"},
    "jemalloc, pages back after 1 s": {
        "grpo": {},
        "sft": {},
        "trim": True,
        "pin": False,
        "preload": "jemalloc",
        "env": {"MALLOC_CONF": "dirty_decay_ms:1000,muzzy_decay_ms:0"},
    },
    "tcmalloc": {"grpo": {}, "sft": {}, "trim": True, "pin": False, "preload": "tcmalloc"},
    # mimalloc from its wheel (cmeel-mimalloc, an agl dependency: agl.memory.WHEELS), with its own defaults
    "mimalloc": {"grpo": {}, "sft": {}, "trim": True, "pin": False, "preload": "mimalloc"},
}


class RssSampler:
    """A thread reading /proc/self/statm every ``interval`` s: the current phase's peak resident size."""

    def __init__(self, interval: float = 0.01):
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> int:
        now = self.rss()
        self.peak = now
        return now


class SavedTensors:
    """Bytes autograd holds for backward (distinct storages), live and at their peak: the update's activations.

    Tensors saved inside a checkpointed region are the checkpoint's business and are not seen here."""

    def __init__(self):
        self.live: dict[int, list] = {}  # storage address -> [bytes, references]
        self.bytes = self.peak = 0

    def pack(self, tensor):
        import weakref

        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.bytes += entry[0]
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        holder = [tensor]
        box = type("Saved", (), {})()
        box.t = holder[0]
        weakref.finalize(box, self._release, key)
        return box

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[key]

    @staticmethod
    def unpack(box):
        return box.t

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def phases_child(variant: dict, decode_prompts: int, decode_batch: int) -> dict:
    """The default job's phases, in order, in this (fresh) process: per phase RSS at its start, its peak and at its
    end."""
    from agl.memory import release_freed_memory, trim

    if variant.get("pin", True):
        release_freed_memory()  # as harness.py does, before torch allocates
    import dataclasses

    import agl.train.logprobs

    agl.train.logprobs.CHUNK_BYTES = variant.get("head_chunk_bytes", agl.train.logprobs.CHUNK_BYTES)
    import agl.memory

    agl.memory.UPDATE_MMAP_THRESHOLD_BYTES = variant.get(
        "update_mmap_threshold", agl.memory.UPDATE_MMAP_THRESHOLD_BYTES
    )
    import random
    import time

    import torch

    from agl.config import GRPOConfig, SFTConfig
    from agl.policy.engine import Engine, SamplingParams
    from agl.train.advantages import ESTIMATORS, advantages
    from agl.train.grpo import GRPOUpdate
    from agl.train.samples import Sample
    from agl.train.sft import render_demonstration, sft_loss_and_backward
    from bench.common import gsm8k_prompts, load_model
    from tasks.gsm8k.agent import demonstrations

    grpo = dataclasses.replace(
        GRPOConfig(max_tokens=256), **variant["grpo"]
    )  # the yaml sets max_tokens from task.max_tokens (256)
    sft = dataclasses.replace(SFTConfig(), **variant["sft"])
    mib = 2**20
    phases: list[dict] = []
    sampler = RssSampler()

    def phase(name: str, what: str, run, *args):
        start = sampler.reset()
        began = time.perf_counter()
        out = run(*args)
        end = sampler.rss()
        record = {
            "phase": name,
            "start_mib": start / mib,
            "peak_mib": sampler.peak / mib,
            "end_mib": end / mib,
            "delta_mib": (sampler.peak - start) / mib,
            "seconds": time.perf_counter() - began,
            "what": what,
        }
        if variant["trim"]:
            trim()
            record["trimmed_mib"] = sampler.rss() / mib
        phases.append(record)
        print(json.dumps(record), file=sys.stderr, flush=True)
        return out

    with sampler:
        policy = phase("load policy", "", load_model)
        model = policy.model
        weights = tensor_bytes([*model.parameters(), *model.buffers()])
        adapter = tensor_bytes(policy.trainable_parameters())
        phases[-1]["what"] = (
            f"model {weights / mib:.0f} MiB (4-bit linears, fp32 embeddings/norms), LoRA {adapter / mib:.1f} MiB"
        )
        config = model.get_base_model().config
        kv_per_token = (
            2
            * config.num_hidden_layers
            * config.num_key_value_heads
            * (config.hidden_size // config.num_attention_heads)
            * 4
        )

        engine = Engine(policy, max_batch_size=decode_batch)
        dense = phase(
            "sampler weights",
            "",
            lambda: tensor_bytes(b for m in engine.merged.model().modules() for b in m.buffers(recurse=False)),
        )
        phases[-1]["what"] = (
            f"dense base+LoRA linears in {str(policy.compute_dtype).removeprefix('torch.')}: {dense / mib:.0f} MiB"
        )

        async def decode(prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list:
            await engine.start()
            gate = asyncio.Semaphore(decode_batch)

            async def one(p: list[int]) -> list:
                async with gate:
                    return [await s.wait() for s in engine.submit(p, params, n)]

            return [s for seqs in await asyncio.gather(*(one(p) for p in prompts)) for s in seqs]

        loop = (
            asyncio.new_event_loop()
        )  # one loop for the engine's whole life (its events belong to the loop it started in)

        tok = policy.render_chat
        test = [tok([{"role": "user", "content": r["prompt_text"]}]) for r in gsm8k_prompts("test", decode_prompts)]
        seqs = phase(
            "eval decode",
            "",
            lambda: loop.run_until_complete(
                decode(test, SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True))
            ),
        )
        rows = min(decode_batch, decode_prompts)
        longest = max(len(p) for p in test[:rows]) + 256
        phases[-1]["what"] = (
            f"{decode_prompts} prompts x 256 tokens, batch {rows}: "
            f"KV cache {kv_per_token * sum(len(p) + 256 for p in test[:rows]) / mib:.0f} MiB "
            f"filled, {kv_per_token * rows * longest / mib:.0f} MiB as one left-padded batch; "
            f"logits [{rows}, {config.vocab_size}] fp32 "
            f"{rows * config.vocab_size * 4 / mib:.0f} MiB; "
            f"{sum(len(s.token_ids) for s in seqs) / phases[-1]['seconds']:.0f} tokens/s"
        )

        random.seed(0)
        from omegaconf import OmegaConf

        demos = demonstrations(
            "train", prompt_template=OmegaConf.load(ROOT / "conf" / "task" / "gsm8k.yaml").prompts.cot
        )
        examples = [
            render_demonstration(policy, demos[i], sft.max_length)
            for i in random.sample(range(len(demos)), sft.batch_size)
        ]
        sft_optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=sft.lr, weight_decay=sft.weight_decay)
        saved = SavedTensors()

        def sft_step() -> dict:
            with agl.memory.update_memory():  # as agl/train/sft.py's update
                policy.model.train()
                sft_optimizer.zero_grad(set_to_none=True)
                with saved.hooks():
                    stats = sft_loss_and_backward(
                        policy, examples, sft.micro_batch_size, sft.micro_batch_tokens, sft.gradient_checkpointing
                    )
                torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), sft.max_grad_norm)
                sft_optimizer.step()
                policy.model.eval()
            return stats

        stats = phase("SFT warm-up step", "", sft_step)
        opt = tensor_bytes(t for s in sft_optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        phases[-1]["what"] = (
            f"batch {sft.batch_size} x {sum(len(i) for i, _ in examples) / len(examples):.0f} tokens, "
            f"micro-batch {sft.micro_batch_size}: "
            f"autograd-saved tensors peak {saved.peak / mib:.0f} MiB; AdamW state {opt / mib:.0f} MiB, "
            f"gradients {adapter / mib:.0f} MiB; loss {stats['loss']:.6f}"
        )
        policy.version += 1

        train = gsm8k_prompts("train", 64)
        picked = [tok([{"role": "user", "content": r["prompt_text"]}]) for r in random.sample(train, grpo.batch_size)]
        params = SamplingParams(max_tokens=grpo.max_tokens, temperature=grpo.temperature, top_p=grpo.top_p, seed=0)
        seqs = phase("GRPO rollouts", "", lambda: loop.run_until_complete(decode(picked, params, grpo.group_size)))
        rows = grpo.batch_size * grpo.group_size
        phases[-1]["what"] = (
            f"B{grpo.batch_size} x G{grpo.group_size} <= {grpo.max_tokens} tokens "
            f"(mean {sum(len(s.token_ids) for s in seqs) / len(seqs):.0f}): "
            f"KV cache {kv_per_token * sum(len(s.prompt_ids) + len(s.token_ids) for s in seqs) / mib:.0f} MiB filled, "
            f"{kv_per_token * rows * (max(len(p) for p in picked) + grpo.max_tokens) / mib:.0f} MiB "
            f"at {rows} rows x the longest"
        )
        # Rewards 0/1 alternating in each group, so every group trains (the most tokens an update can get); memory does
        # not depend on their values.
        samples = [
            Sample(
                str(i),
                list(s.prompt_ids),
                list(s.token_ids),
                [1] * len(s.token_ids),
                list(s.logprobs),
                float(i % 2),
                s.finish_reason == "length",
                grpo.temperature,
                group=str(i // grpo.group_size),
            )
            for i, s in enumerate(seqs)
        ]
        advs, _ = advantages(samples, ESTIMATORS.get(grpo.advantage))
        update = GRPOUpdate(policy, grpo)
        saved = SavedTensors()

        def grpo_update() -> dict:
            with saved.hooks():
                return update.step(samples, advs)

        metrics = phase("GRPO update", "", grpo_update)
        opt = tensor_bytes(t for s in update.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        from agl.train.micro_batches import plan_micro_batches

        chunks = plan_micro_batches(samples, grpo.micro_batch_size, grpo.micro_batch_tokens)
        most = max(sum(len(samples[i].completion_ids) for i in c) for c in chunks)
        phases[-1]["what"] = (
            f"{len(samples)} samples, {metrics['train_input_tokens']:.0f} tokens run in {len(chunks)} micro-batches: "
            "autograd-saved tensors "
            f"peak {saved.peak / mib:.0f} MiB; fused head's probabilities [{most}, {config.vocab_size}] fp32 "
            f"{most * config.vocab_size * 4 / mib:.0f} MiB "
            f"(in it); AdamW state {opt / mib:.0f} MiB; "
            f"loss {metrics['loss']:.6f}, grad_norm {metrics['grad_norm']:.6f}"
        )
        loop.run_until_complete(engine.stop())
        loop.close()
        import resource

        return {
            "phases": phases,
            "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "sft_loss": stats["loss"],
            "grpo_loss": metrics["loss"],
            "grpo_grad_norm": metrics["grad_norm"],
            "update_s": metrics.get("forward_s", 0) + metrics.get("backward_s", 0),
            "sft_s": phases[3]["seconds"],
        }


def phases_main(args) -> None:
    """Each variant's phases in a fresh process, variants alternating per round; the first variant is the reference."""
    runs: dict[str, list[dict]] = {name: [] for name in args.variants}
    for _ in range(args.rounds):
        for name in args.variants:
            command = [
                sys.executable,
                __file__,
                "--phases-child",
                name,
                "--prompts",
                str(args.prompts),
                "--batch",
                str(args.batch),
            ]
            variant = PHASE_VARIANTS[name]
            env = {**os.environ, "PYTHONPATH": str(ROOT), **variant.get("env", {})}
            if "preload" in variant:
                env["LD_PRELOAD"] = getattr(args, variant["preload"])
            out = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, json.dumps({p["phase"]: round(p["peak_mib"]) for p in runs[name][-1]["phases"]}), flush=True)
    first = args.variants[0]
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "prompts": args.prompts,
        "batch": args.batch,
        "rounds": args.rounds,
        "variants": {name: PHASE_VARIANTS[name] for name in args.variants},
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    last = {name: rs[-1] for name, rs in runs.items()}
    lines = [
        "# Resident memory of the default GRPO job, phase by phase",
        "",
        f"{result['date']}. `PYTHONPATH=. .venv/bin/python bench/memory.py --phases --prompts {args.prompts} "
        f"--batch {args.batch} --rounds {args.rounds} "
        f"--variants {' '.join(args.variants)}`. "
        "SmolLM2-135M-Instruct (nf4 + LoRA r16), this CPU's compute dtype, mmap threshold pinned as harness.py does. "
        "One process per variant "
        "runs the default job's phases in order: load the policy; build the engine's merged sampler weights; "
        "an eval-like greedy decode "
        f"({args.prompts} GSM8K test prompts x 256 tokens, eos ignored, engine batch {args.batch}, no HTTP); "
        "one SFT warm-up step (SFTConfig's "
        "defaults: 8 demonstrations, micro-batch 4); "
        "one GRPO step's rollouts (4 train prompts x 8 samples, <= 256 tokens, temperature 0.8) and its "
        "update (GRPOConfig's defaults; rewards 0/1 alternating so every group trains). "
        "RSS sampled from /proc/self/statm every 10 ms.",
        "",
    ]
    for name, run in last.items():
        lines += [
            f"## {name}: {json.dumps(PHASE_VARIANTS[name])}",
            "",
            "| phase | RSS at start (MiB) | peak (MiB) | peak - start (MiB) | RSS at end (MiB) | s | what it is |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        lines += [
            f"| {p['phase']} | {p['start_mib']:.0f} | {p['peak_mib']:.0f} | {p['delta_mib']:+.0f} | {p['end_mib']:.0f}"
            + (f" ({p['trimmed_mib']:.0f} trimmed)" if "trimmed_mib" in p else "")
            + f" | {p['seconds']:.1f} | {p['what']} |"
            for p in run["phases"]
        ]
        lines += ["", f"Process peak (ru_maxrss): {run['ru_maxrss_mib']:.0f} MiB.", ""]
    if len(last) > 1:
        ref = last[first]
        lines += [
            "## Side by side (last round)",
            "",
            "| variant | "
            + " | ".join(f"{p['phase']} peak" for p in ref["phases"])
            + " | process peak | SFT step s | GRPO fwd+bwd s | SFT loss | GRPO loss | GRPO grad norm |",
            "|---|" + "---:|" * (len(ref["phases"]) + 6),
        ]
        for name, run in last.items():
            lines.append(
                f"| {name} | "
                + " | ".join(f"{p['peak_mib']:.0f}" for p in run["phases"])
                + f" | {run['ru_maxrss_mib']:.0f} | "
                f"{run['sft_s']:.1f} ({run['sft_s'] / ref['sft_s']:.2f}x) | "
                f"{run['update_s']:.1f} ({run['update_s'] / ref['update_s']:.2f}x) | "
                f"{run['sft_loss']:.6f} | {run['grpo_loss']:.6f} | {run['grpo_grad_norm']:.6f} |"
            )
        lines.append("")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--prompts", type=int, default=None, help="GSM8K test prompts decoded (default 128; --phases: 64)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true")
    parser.add_argument(
        "--phases", action="store_true", help="the default job's phases, one process per variant (PHASE_VARIANTS)"
    )
    parser.add_argument("--phases-child", metavar="VARIANT")
    parser.add_argument("--batch", type=int, default=64, help="--phases: the engine's batch (engine.max_batch_size)")
    parser.add_argument(
        "--name", default="memory_phases", help="--phases: the results' name (bench/results/<name>.md and .json)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(PHASE_VARIANTS),
        default=list(PHASE_VARIANTS),
        help="--phases: which variants to run",
    )
    for name in ALLOCATORS:  # agl.memory's names for them, as AGL_ALLOCATOR takes them
        parser.add_argument(
            f"--{name}", default=find_allocator(name), help=f"--phases: the {name} library its variants preload"
        )
    args = parser.parse_args()
    for name in {PHASE_VARIANTS[v].get("preload") for v in args.variants if args.phases} - {None}:
        if not getattr(args, name):
            parser.error(
                f"variant(s) preloading {name} asked for, but no {name} library was found: pass --{name} PATH "
                f"({ALLOCATORS[name][1]}; a Debian package can also be apt-get download-ed and dpkg-deb -x-ed)"
            )
    args.prompts = args.prompts or (64 if args.phases or args.phases_child else 128)
    if args.phases_child:
        print(json.dumps(phases_child(PHASE_VARIANTS[args.phases_child], args.prompts, args.batch)))
        return
    if args.phases:
        phases_main(args)
        return
    if args.child:
        print(json.dumps(child(args.prompts)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name, env in VARIANTS.items():
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--prompts", str(args.prompts)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                capture_output=True,
                text=True,
                check=True,
            )
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(name, runs[name][-1], flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    base, pinned = (median[name] for name in VARIANTS)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "prompts": args.prompts,
        "rounds": args.rounds,
        "runs": runs,
        "median": median,
        "speed_ratio_pinned_over_default": pinned["tokens_per_s"] / base["tokens_per_s"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Resident memory of the engine's decode: default malloc vs. the pinned mmap threshold",
        "",
        f"{result['date']}. SmolLM2-135M-Instruct (nf4 + LoRA, merged sampler), CPU. "
        f"{args.prompts} GSM8K test prompts x 256 greedy "
        "tokens, 64 at a time, through `Engine` (no HTTP). "
        f"Medians of {args.rounds} rounds, variants alternating, each in a fresh process. "
        "Written by `bench/memory.py`.",
        "",
        "| malloc | RSS after load (MiB) | peak RSS (MiB) | RSS at the end (MiB) | tokens/s |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {m['loaded_mib']:.0f} | {m['peak_mib']:.0f} | {m['end_mib']:.0f} | {m['tokens_per_s']:.1f} |"
            for name, m in median.items()
        ),
        "",
        f"tokens/s, pinned / default: {result['speed_ratio_pinned_over_default']:.2f} (per round: "
        + ", ".join(f"{p['tokens_per_s'] / d['tokens_per_s']:.2f}" for d, p in zip(*runs.values()))
        + ")",
        "",
    ]
    (RESULTS / "memory.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
