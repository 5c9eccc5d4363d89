"""What a training job is about to do, and how long each part should take on this machine.

At its start a job prints its phases (the baseline eval, the SFT warm-up, GRPO's steps, the evals, the
final eval) with an estimate of each, from rates measured here in a few seconds (``measure_rates``): the
engine prefilling and decoding a batch as wide as the job's runners keep it, and one forward and backward
pass of the policy over a few sequences as long as the job's. As each phase ends it prints one line with
its time next to the estimate, so a user knows early whether the job fits their patience.

An eval or a GRPO step is priced at ``max_tokens`` per problem and one agent call per problem: a trained policy's
shorter answers make the estimate an upper one for decoding, though the prompts' prefill does not shrink with them.
A decode step costs more as the rows' caches grow (attention reads every cached position), so the probe times it
twice, at the prompt's length and at the prompt's length plus ``max_tokens``, and a row's steps are priced at their
mean (exact where the cost grows linearly with the cache). And an eval's first ``batch`` prompts are prefilled
together, but the rest one by one as rows finish, at 2-3x the cost per token: the probe times a lone prompt's prefill
too. The engine's and the route's work around each call is not priced (how close the estimates came:
docs/benchmarks-history.md#plan-estimates). So the estimates are estimates, not bounds. Rows the eval cache holds
cost nothing. Left out: the time to load the model and start the route (before the plan), the cost of a multi-turn
agent's further calls, and the first matmuls' kernel compilation (the probe pays it, once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from agl.policy import compute_thread
from agl.policy.engine import SamplingParams

if TYPE_CHECKING:
    from agl.runtime import Runtime

PROBE_DECODE_STEPS = 8  # decode steps timed after the prefill's
PROBE_LONE_PREFILLS = 3  # prompts prefilled alone, one after another
PROBE_TRAIN_TOKENS = 512  # tokens of the timed forward and backward pass


@dataclasses.dataclass
class Rates:
    """What the probe measured on this machine, with this policy."""

    batch: int  # rows decoded together (the job's concurrent rollouts, up to the engine's batch)
    prefill_s_per_token: float  # ``batch`` distinct prompts prefilled together
    prefill_one_s_per_token: float  # one prompt prefilled alone (an eval's row that replaces a finished one)
    decode_step_s: float  # one decode step of ``batch`` rows whose caches hold a prompt
    decode_last_step_s: float  # the same with a prompt and ``max_tokens`` cached: a row's last step
    train_s_per_token: float  # forward + backward pass of the policy, per token
    probe_s: float  # what measuring them took

    @property
    def mean_decode_step_s(self) -> float:
        """A row's decode steps on average, from its first to its ``max_tokens``-th."""
        return (self.decode_step_s + self.decode_last_step_s) / 2

    def decode_s(self, rows: int, max_tokens: int) -> float:
        """Estimate: ``rows`` rows, ``batch`` at a time, each decoding ``max_tokens``."""
        return rows * max_tokens / max(1, min(self.batch, rows)) * self.mean_decode_step_s

    def eval_s(self, problems: int, prompt_tokens: int, max_tokens: int) -> float:
        """Estimate: every problem one call, its prompt prefilled (the first ``batch`` together, the rest alone)
        and ``max_tokens`` decoded."""
        together = min(self.batch, problems)
        prefill_s = prompt_tokens * (
            together * self.prefill_s_per_token + (problems - together) * self.prefill_one_s_per_token
        )
        return prefill_s + self.decode_s(problems, max_tokens)

    def describe(self) -> str:
        return (
            f"decode {self.batch} rows {self.decode_step_s * 1e3:.0f}-{self.decode_last_step_s * 1e3:.0f} ms/step, "
            f"prefill {self.prefill_s_per_token * 1e3:.2f} ms/token ({self.prefill_one_s_per_token * 1e3:.2f} alone), "
            f"update {self.train_s_per_token * 1e3:.2f} ms/token; measured in {self.probe_s:.1f} s"
        )


def _cycled(ids: Sequence[int], length: int) -> list[int]:
    """``ids`` repeated to ``length`` tokens."""
    return (list(ids) * (length // max(1, len(ids)) + 1))[:length]


async def measure_rates(
    rt: Runtime,
    prompt_ids: Sequence[int],
    batch: int,
    max_tokens: int,
    train_length: int,
    backward: Callable[..., Any],
) -> Rates:
    """Time the engine on ``batch`` prompts like ``prompt_ids`` (greedy, distinct, so none share a prefill),
    on one such prompt alone (the median of ``PROBE_LONE_PREFILLS``),
    its decode step again with ``max_tokens`` more positions cached (``batch`` rows of one longer prompt,
    prefilled once), and ``backward(policy, examples, micro_batch_size)`` (the SFT loss's forward and backward pass,
    ``agl.train.sft.sft_loss_and_backward`` with the job's checkpointing) on sequences of ``train_length``
    tokens. Neither changes anything the job computes: the engine's greedy rows draw no random numbers, the
    pass's gradients are dropped, and torch's random state is put back."""
    started = time.perf_counter()
    batch = max(1, min(batch, rt.engine.max_batch_size))
    vocab = len(rt.policy.tokenizer)
    prompts = [list(prompt_ids) + [(7 + i) % vocab] for i in range(batch)]  # a distinct last token each

    async def decode(call: Sequence[Sequence[int]], new_tokens: int, n: int = 1) -> tuple[float, float]:
        """One call (``n`` continuations of each prompt in ``call``), timed by its sequences' own clocks:
        (prefill, decode steps) seconds. The prefill ends when the last row has its first token (from the first
        admission: a lone prompt's wait for company, the engine's ``batch_wait_s``, is not prefill), and the
        decode steps after it are that row's remaining tokens (not a long call's time minus a short one's, which
        the prefill's noise swamps: docs/benchmarks-history.md#plan-estimates)."""
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        streams = [s for p in call for s in rt.engine.submit(list(p), params, n=n)]
        await asyncio.gather(*(s.wait() for s in streams))
        prefilled = max(s.first_token_at for s in streams)
        return prefilled - min(s.admitted_at for s in streams), max(s.finished_at for s in streams) - prefilled

    await decode(prompts, 2)  # the first forward passes at this width compile their kernels: not timed
    prefill_s, decode_s = await decode(prompts, 1 + PROBE_DECODE_STEPS)
    prompt_tokens = sum(len(p) for p in prompts)
    lone = [list(prompt_ids) + [(7 + batch + i) % vocab] for i in range(PROBE_LONE_PREFILLS)]
    lone_s = statistics.median([(await decode([p], 1))[0] / len(p) for p in lone])
    # The last step's cache: the prompt and max_tokens, one prompt that long repeated over the batch's rows
    longest = max(
        len(prompt_ids) + 1, min(len(prompt_ids) + max_tokens, rt.policy.context_length - 2 - PROBE_DECODE_STEPS)
    )
    long_prompt = _cycled(prompts[0], longest)
    _, last_decode_s = await decode([long_prompt], 1 + PROBE_DECODE_STEPS, n=batch)

    length = max(8, min(train_length, rt.policy.context_length))
    rows = max(1, PROBE_TRAIN_TOKENS // length)
    ids = _cycled(prompt_ids, length)
    examples = [(ids, [0] * (length // 2) + [1] * (length - length // 2)) for _ in range(rows)]

    def train_pass() -> float:
        with torch.random.fork_rng(devices=[]):
            policy = rt.policy
            policy.model.train()
            try:
                backward(policy, [(ids[:16], [0] * 8 + [1] * 8)], 1)  # the first pass compiles kernels: not timed
                begun = time.perf_counter()
                backward(policy, examples, rows)
                return time.perf_counter() - begun
            finally:
                for p in policy.trainable_parameters():
                    p.grad = None
                policy.model.eval()

    async with rt.engine.paused():
        train_s = await compute_thread.run(train_pass)
    return Rates(
        batch=batch,
        prefill_s_per_token=prefill_s / prompt_tokens,
        prefill_one_s_per_token=lone_s,
        decode_step_s=decode_s / PROBE_DECODE_STEPS,
        decode_last_step_s=last_decode_s / PROBE_DECODE_STEPS,
        train_s_per_token=train_s / (rows * length),
        probe_s=time.perf_counter() - started,
    )


def probe_prompt(rt: Runtime, rows: Sequence[dict], prompt: str) -> list[int]:
    """Token ids of a prompt like the job's: its first eval row through the task's template where the row
    fills it, else the template alone."""
    template = rt.task.resources_for(prompt).get("prompt_template") or "{question}"
    row = rows[0] if rows else {}
    try:
        text = template.format(**row)
    except (KeyError, IndexError, ValueError):
        text = template
    return rt.policy.render_chat([{"role": "user", "content": text}])


def duration(seconds: float | None) -> str:
    """``1 h 02 min``, ``4 min 05 s``, ``12.3 s``.

    >>> duration(3725), duration(245), duration(12.34), duration(None)
    ('1 h 02 min', '4 min 05 s', '12.3 s', '?')
    """
    if seconds is None or math.isnan(seconds):
        return "?"
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    if seconds >= 60:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{seconds:.1f} s"


@dataclasses.dataclass
class Phase:
    name: str
    what: str  # its size, in words
    estimate_s: float | None
    units: int = 1  # how many times ``tick`` ends it (evals of a group, steps)
    done: int = 0
    elapsed_s: float = 0.0


class JobPlan:
    """A job's phases: printed with their estimates at the start, one line each as they end."""

    def __init__(self, phases: Sequence[Phase], rates: Rates | None, echo: Callable[[str], object] | None = None):
        self.phases = [p for p in phases if p.units > 0]
        self.rates = rates
        self.echo = echo or tqdm.write  # under the progress bars, not through them
        self._started: dict[str, float] = {}

    def announce(self) -> None:
        total = sum(p.estimate_s or 0.0 for p in self.phases)
        lines = ["plan" + (f" (rates measured here: {self.rates.describe()}):" if self.rates else ":")]
        width = max((len(p.name) for p in self.phases), default=0)
        what = max((len(p.what) for p in self.phases), default=0)
        for i, phase in enumerate(self.phases, 1):
            lines.append(f"  {i}. {phase.name:<{width}}  {phase.what:<{what}}  ~{duration(phase.estimate_s)}")
        lines.append(
            f"  total ~{duration(total)} (evals and GRPO priced at max_tokens an answer: shorter ones take less)"
        )
        self.echo("\n".join(lines))

    def begin(self, name: str) -> None:
        self._started[name] = time.perf_counter()

    def tick(self, name: str) -> None:
        """One unit of phase ``name`` ended (begun with ``begin``); its last prints the phase's line."""
        phase = next((p for p in self.phases if p.name == name), None)
        started = self._started.pop(name, None)
        if phase is None or started is None:
            return
        phase.elapsed_s += time.perf_counter() - started
        phase.done += 1
        if phase.done == phase.units:
            index = self.phases.index(phase) + 1
            self.echo(
                f"phase {index} of {len(self.phases)} done, {phase.name}: {duration(phase.elapsed_s)} "
                f"(estimated ~{duration(phase.estimate_s)})"
            )
