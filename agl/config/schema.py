"""Typed configs: the one home of every default, registered with Hydra as the groups' schemas.

Each ``conf/<group>/<name>.yaml`` lists its schema first in ``defaults`` (``- grpo_schema``) and
holds only what differs from it (its choices, and interpolations such as ``${task.max_tokens}``),
so Hydra type-checks every override and rejects a mistyped key (``algo.lrr=1``) by name. Code
outside Hydra (tests, benches, a library user) gets the same defaults from the same dataclasses:
``GRPOConfig()`` is what ``algo=grpo`` runs.

A run saved before a key existed still resumes: ``agl.jobs.dispatch.resumed_config`` merges the saved
config onto these schemas (``with_schema``), so a missing key takes its default here.

Tasks are user-extensible: ``TaskConfig`` types the keys agl reads and keeps ``resources``,
``prompts`` and ``recipe`` open (any keys); a task yaml of the user's own need not list it.

No torch here: ``harness.py`` registers these before every job, ``report=`` included.
"""

from __future__ import annotations

import copy
import dataclasses
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agl.errors import ConfigError

NO_API_KEY = "agl"  # what clients send when server.api_key is null (the route then checks no key)


def doc(default: Any, text: str, open_keys: bool = False) -> Any:
    """A schema key: its default, and its doc in the field's metadata (``metadata["doc"]``), where code reads it:
    ``python -m agl.config.reference`` writes docs/config-reference.md from these. A list, a dict or a nested config
    as the default is copied for each instance (dataclasses' ``default_factory``). ``open_keys``: a mapping whose
    keys a command line sets without ``+`` (``algo.loss.tau_pos=1.0``); what it holds is checked by its user."""
    metadata = {"doc": text, "open_keys": open_keys}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# ----------------------------------------------------------------------------- top level


@dataclasses.dataclass
class RunnerConfig:
    """``runner.*``: asyncio workers that run the agent on dequeued rollouts (agl/agents/runner.py)."""

    n: int = doc(
        32, "concurrent rollouts in the job's process (the engine batches their LLM calls); 0: runner processes only"
    )
    processes: int = doc(
        0, "runner processes the job starts (agl/agents/attach.py), for agents that hold the GIL or block"
    )
    per_process: int = doc(8, "concurrent rollouts in each runner process (its runner.n)")
    timeout_seconds: int = doc(600, "per attempt, from its start; a longer attempt is `timeout`")
    unresponsive_seconds: int = doc(
        300, "an attempt with no heartbeat for this long is `unresponsive` (agl/store/rules.py)"
    )
    max_attempts: int = doc(2, "attempts charged to a rollout before a retryable failure is final")
    retry_condition: list[str] = doc(
        ["failed", "timeout", "unresponsive"], "the attempt statuses that send a rollout back to the queue"
    )
    collect_every: int = doc(
        32, "finished rollouts between full garbage collections + malloc_trim (agl.memory.collect); 0: never"
    )
    launcher: str = doc(
        "local",
        "where runner.processes start: local (subprocesses) | ray (actors on a Ray cluster; the ray extra) | "
        "slurm | submitit_local (submitit's executors); all but local join by the store's URL (agl/agents/launch.py)",
    )
    launcher_args: dict[str, Any] = doc(
        {},
        "ray: address (null: RAY_ADDRESS, else a local cluster) and the actors' options (num_cpus, resources, "
        "runtime_env); slurm: submitit's parameters (slurm_partition, timeout_min, ...); local: none",
    )


@dataclasses.dataclass
class EngineConfig:
    """``engine.*``: the batched sampler (agl/policy/engine.py)."""

    max_batch_size: int = doc(64, "sequences decoded together")
    max_prefill_tokens: int = doc(8192, "prompt tokens prefilled in one engine step at most")
    weights: str = doc(
        "merged", "merged: dense base+LoRA matrices, re-merged after each update | adapter: through the training model"
    )
    batch_invariant: Any = doc(
        "auto", "auto (on when model.compute_dtype=float32) | true | false (agl.runtime.batch_invariant)"
    )
    decode: str = doc(
        "fast",
        "fast: agl/policy/decode.py's step for Llama-family merged samplers | model: the model's forward | "
        "graph: fast's step in static shapes, replayed as CUDA graphs on a GPU (agl/policy/graph_decode.py)",
    )
    decode_4bit_rows: int = doc(
        8, "fast decode steps of at most this many rows read the NF4 base + LoRA (bf16 on a CPU); 0: always dense"
    )


@dataclasses.dataclass
class ServerConfig:
    """``server.*``: the OpenAI-compatible route agents call (agl/route/server.py)."""

    host: str = doc("127.0.0.1", "a non-loopback address needs api_key (or allow_public): check_server_exposure")
    port: int = doc(0, "0: a free port")
    api_key: Optional[str] = doc(None, 'set to require "Authorization: Bearer <key>"')
    allow_public: bool = doc(False, "serve a non-loopback host without api_key (anyone who reaches it may call it)")
    max_request_bytes: int = doc(4 * 1024 * 1024, "a larger request body is a 413, refused before it is held whole")
    frozen_models: list[str] = doc(["base"], "names served as the base model (adapter off)")
    default_max_tokens: int = doc(1024, "for a call that gives no max_tokens (rollouts normally carry their algo's)")
    history_attempts: int = doc(256, "attempts whose recent turns the route keeps in memory for prefix reuse (LRU)")
    history_turns: int = doc(8, "turns kept per attempt; older ones are read back from the store's spans")
    stored_responses: int = doc(
        1024, "Responses API: the last N stored responses kept for previous_response_id and GET"
    )


@dataclasses.dataclass
class EvalCacheConfig:
    """``eval_cache.*``: greedy evals' scores kept per problem across runs and jobs (agl/eval/cache.py)."""

    dir: Optional[str] = doc(None, "null: $AGL_EVAL_CACHE, else $AGL_CACHE/evals, else ~/.cache/agl/evals")
    reuse: str = doc(
        "any",
        "any: reuse every row whose key matches | exact: only rows a batch-invariant engine computed (bit-for-bit "
        "replays; a bf16 batched job then recomputes its evals) | off: neither read nor write",
    )


@dataclasses.dataclass
class StoreConfig:
    """``store.*``: the run's store served over HTTP (agl/store/server.py), or a store a job joins by URL."""

    url: Optional[str] = doc(
        None,
        "a store served elsewhere (algo=store), e.g. http://host:4747: the job, runner or server uses it instead "
        "of its run dir's store.sqlite",
    )
    host: str = doc(
        "127.0.0.1", "where algo=store listens (a job serving its own store too); non-loopback needs api_key"
    )
    port: int = doc(4747, "where algo=store listens; 0: a free port")
    api_key: Optional[str] = doc(
        None, 'a server requires "Authorization: Bearer <key>" of every request; a client sends it'
    )
    allow_public: bool = doc(False, "serve a non-loopback host without api_key (anyone who reaches it may write)")
    session_timeout: float = doc(
        30.0,
        "seconds without a heartbeat after which a client's session (a runner or job joined by URL) is ended: its "
        "attempts go back to the queue uncharged (agl/store/sessions.py)",
    )
    ssl_certfile: Optional[str] = doc(None, "serve HTTPS with this certificate (PEM; uvicorn's ssl_certfile)")
    ssl_keyfile: Optional[str] = doc(None, "... and this private key (PEM); clients trust the certificate's CA")


def store_ssl(store: Any) -> dict[str, str]:
    """``store.ssl_*`` as uvicorn's ssl options (empty: plain HTTP)."""
    return {k: v for k, v in (("ssl_certfile", store.ssl_certfile), ("ssl_keyfile", store.ssl_keyfile)) if v}


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only (127.0.0.0/8, ::1, or a name resolving to
    nothing else). An empty host, a wildcard (0.0.0.0, ::) or a name that does not resolve is not."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        resolved = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)} if host else set()
    except (OSError, UnicodeError):
        return False
    return bool(resolved) and all(ipaddress.ip_address(address).is_loopback for address in resolved)


SERVED = {"server": "call the route", "store": "read and write the store"}


def check_exposure(section: str, host: str, api_key: Optional[str], allow_public: bool) -> None:
    """Refuse to serve ``section`` (``server``: the route; ``store``: the store) on a non-loopback address
    without a key: it would serve (and, for the route in training, record the traffic of) anyone who can reach
    the machine. ``<section>.api_key`` or ``<section>.allow_public=true`` opts in."""
    if api_key or allow_public or is_loopback(host):
        return
    raise ConfigError(
        f"{section}.host={host} is not a loopback address and {section}.api_key is not set, so anyone who can "
        f"reach this machine could {SERVED[section]}: set {section}.api_key=<secret> (clients send it as the "
        f"Bearer token), or {section}.allow_public=true to serve it without a key"
    )


def check_server_exposure(server: Any) -> None:
    """``check_exposure`` of the route (``server.*``)."""
    check_exposure("server", server.host, server.api_key, server.allow_public)


def client_api_key(server: Any) -> str:
    """The key clients of the route send: ``server.api_key``, or the placeholder when the route checks none."""
    return server.api_key or NO_API_KEY


@dataclasses.dataclass
class Config:
    """The top level (conf/config.yaml). ``model``, ``task`` and ``algo`` come from their groups."""

    model: Any = doc(MISSING, "the model group: model=<name> picks conf/model/<name>.yaml (ModelConfig)")
    task: Any = doc(MISSING, "the task group: task=<name> picks conf/task/<name>.yaml (TaskConfig)")
    algo: Any = doc(MISSING, "the algo group: algo=<name> picks conf/algo/<name>.yaml (its schema: ALGO_SCHEMAS)")
    seed: int = doc(0, "the run's seed (agl/seeding.py): sampling and the LoRA's initialisation derive from it")
    device: str = doc("auto", "auto | cpu | cuda")
    progress: bool = doc(True, "tqdm bars")
    resume: Optional[str] = doc(None, "a run dir to continue")
    report: Optional[str] = doc(None, "a run dir or sweep dir to summarize (no model loaded)")
    attach: Optional[str] = doc(None, "algo=runner: the run dir of a running job to join as a runner process")
    threads: Optional[int] = doc(None, "torch/OpenMP threads per job; null: auto (agl/jobs/launchers.py)")
    logger: Any = doc(None, "tensorboard | wandb | [tensorboard, wandb] | null (agl/report/loggers.py)")
    runner: RunnerConfig = doc(RunnerConfig(), "runner.*: the asyncio workers that run the agent")
    engine: EngineConfig = doc(EngineConfig(), "engine.*: the batched sampler")
    server: ServerConfig = doc(ServerConfig(), "server.*: the OpenAI-compatible route agents call")
    store: StoreConfig = doc(StoreConfig(), "store.*: the store served over HTTP (algo=store), or joined by URL")
    eval_cache: EvalCacheConfig = doc(EvalCacheConfig(), "eval_cache.*: greedy evals' scores kept across runs")


# ----------------------------------------------------------------------------- model


@dataclasses.dataclass
class LoraConfig:
    """``model.lora.*``: the LoRA adapter that training updates (peft's LoraConfig)."""

    r: int = doc(16, "rank of each adapter's A and B matrices")
    alpha: int = doc(32, "scaling: the update is (alpha / r) * B @ A")
    dropout: float = doc(0.0, "dropout on the adapter's input")
    target_modules: Any = doc(
        "all-linear", "all-linear (every linear layer but the output projection) | a list of names | a regex"
    )
    train_embeddings: bool = doc(
        False,
        "a LoRA (same r, alpha) on the input embedding matrix too (docs/algorithms.md: the vocabulary matrices)",
    )
    train_head: bool = doc(
        False, "a LoRA (same r, alpha) on the output head too (docs/algorithms.md: the vocabulary matrices)"
    )
    train_merged: Any = doc(
        "auto",
        "the update runs each LoRA linear as one matmul with W + scale·B·A (agl/train/merged_lora.py; the same "
        "gradients): auto (on when the policy computes in float32) | true | false",
    )


@dataclasses.dataclass
class TinyConfig:
    """``model.path=tiny``: a random-weight model with the real SmolLM2 tokenizer (conf/model/tiny.yaml; real
    models' shapes: conf/model/shape_*.yaml). The keys are transformers' config keys of the same names."""

    architecture: str = doc("llama", "llama | qwen2 (transformers' LlamaConfig / Qwen2Config)")
    hidden_size: int = doc(64, "width of the residual stream")
    intermediate_size: int = doc(128, "width of each MLP's hidden layer")
    num_hidden_layers: int = doc(2, "decoder layers")
    num_attention_heads: int = doc(4, "query heads per layer")
    num_key_value_heads: int = doc(2, "key/value heads per layer (grouped-query attention)")
    max_position_embeddings: int = doc(2048, "the longest sequence the model takes")
    tie_word_embeddings: bool = doc(True, "one matrix for input embeddings and output head, like SmolLM2's")
    rope_theta: Optional[float] = doc(None, "RoPE base; null: the architecture's default")
    rms_norm_eps: Optional[float] = doc(None, "RMSNorm epsilon; null: the architecture's default")
    seed: int = doc(0, "seeds the random weights")


@dataclasses.dataclass
class ModelConfig:
    """``model.*``: the policy, a 4-bit quantized base model with a LoRA (agl/policy/)."""

    name: str = doc("SmolLM2-135M-Instruct", "the model name the route serves and runs record")
    path: str = doc("embedded", "embedded | tiny | a local HF model dir | a hub id")
    tokenizer: Optional[str] = doc(
        None,
        "path=tiny: a directory holding a HF tokenizer (bench/export_tokenizer.py writes the embedded one's); "
        "null: the embedded model's, converted from its GGUF",
    )
    cache_dir: str = doc(
        "~/.cache/agl", "where the dequantized safetensors copy lives; the yaml reads $AGL_CACHE first"
    )
    quantization: str = doc("nf4", "nf4 | fp4 | int8 | none")
    double_quant: bool = doc(False, "quantize the 4-bit quantization constants too (bitsandbytes' double quant)")
    compute_dtype: str = doc("auto", "auto (bf16 where native, else fp32) | float32 | bfloat16 | float16")
    adapter: Optional[str] = doc(None, "an adapter dir, or a run dir holding one: start from an earlier run")
    lora: LoraConfig = doc(LoraConfig(), "model.lora.*: the adapter that training updates")
    tiny: Optional[TinyConfig] = doc(None, "model.tiny.*: the random-weight model's shape; set by conf/model/tiny.yaml")


# ----------------------------------------------------------------------------- task


DEFAULT_PROMPTS = {"default": "{question}"}  # the templates of a task that lists none (task.prompts empty)


@dataclasses.dataclass
class TaskConfig:
    """The keys agl reads; ``resources``, ``prompts`` and ``recipe`` take any keys (the task's own)."""

    name: str = doc(MISSING, "names the task in run dirs, reports and the store")
    agent: str = doc(MISSING, "module:function")
    data: Any = doc(MISSING, "module:function(split) | a .jsonl path | {split: a .jsonl path}")
    demonstrations: Optional[str] = doc(None, 'for algo=sft: a .jsonl of {"messages": [...]} lines, or module:function')
    max_tokens: int = doc(128, "per LLM call")
    train_split: str = doc("train", "the split training draws its tasks from")
    eval_split: str = doc("test", "the split evals draw their tasks from")
    eval_size: int = doc(16, "the first N rows of eval_split; 0 = all")
    final_eval_size: Optional[int] = doc(
        None,
        "the baseline and final evals of algo=grpo: null = eval_size, 0 = all, else the first eval_size rows and a "
        "choice of the others (seeded by final_eval_seed alone: every run evaluates the same problems) up to this many",
    )
    final_eval_seed: int = doc(0, "seeds final_eval_size's choice of problems (not the run's seed)")
    prompt: str = doc("default", "which of prompts the agent gets")
    prompts: dict[str, Any] = doc({}, "templates the agent gets as prompt_template; empty: DEFAULT_PROMPTS")
    resources: dict[str, Any] = doc({}, "extra keyword arguments for the agent")
    recipe: dict[str, Any] = doc(
        {},
        "warmup_steps, steps, eval_every, batch_size, lr, temperature, dynamic_sampling, max_extra_groups, "
        "gradient_checkpointing: algo=grpo's unless overridden (conf/algo/grpo.yaml)",
    )


# ----------------------------------------------------------------------------- algo

ALGO_NAME = "which algo runs: set by conf/algo/<name>.yaml, read by agl/jobs/dispatch.py"

ALGO_SCHEMAS: dict[str, type] = {}  # algo.name -> its schema, filled by @algorithm


def algorithm(cls: type) -> type:
    """An ``algo=<name>`` schema: a dataclass whose ``name`` defaults to <name>, registered in ``ALGO_SCHEMAS``.

    An algorithm is three files: this schema; ``conf/algo/<name>.yaml``, whose defaults list starts with
    ``<name>_schema``; and ``agl/jobs/<name>.py``, whose ``run(config, run_dir)`` runs it."""
    cls = dataclasses.dataclass(cls)
    name = next(f.default for f in dataclasses.fields(cls) if f.name == "name")
    ALGO_SCHEMAS[name] = cls
    return cls


@algorithm
class SFTConfig:
    """``algo=sft`` (agl/train/sft.py), and ``algo.warmup`` of ``algo=grpo``."""

    name: str = doc("sft", ALGO_NAME)
    split: str = doc("train", "the split whose demonstrations it trains on; the yaml: ${task.train_split}")
    steps: int = doc(100, "optimizer steps")
    epochs: Optional[float] = doc(None, "if set, replaces steps: ceil(epochs * demonstrations / batch_size)")
    batch_size: int = doc(8, "conversations per optimizer step")
    micro_batch_size: int = doc(4, "conversations per forward/backward pass at most")
    micro_batch_tokens: Optional[int] = doc(
        None, "tokens per pass at most, padding included (None: only micro_batch_size bounds them)"
    )
    gradient_checkpointing: bool = doc(
        True,
        "replay each decoder layer in backward instead of keeping its activations "
        "(agl/train/activation_checkpointing.py)",
    )
    lr: float = doc(2e-4, "AdamW learning rate. GSM8K: 40 steps at 2e-4 take format 0 -> 0.79 (RESULTS.md)")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    max_grad_norm: float = doc(1.0, "gradients are clipped to this global norm")
    max_length: int = doc(1024, "tokens per conversation; longer ones are cut")
    eval: bool = doc(True, "false: no evals")
    eval_every: int = doc(0, "steps; also before the first step and after the last")
    max_tokens: int = doc(128, "for the evals; the yaml: ${task.max_tokens}")


@algorithm
class GRPOConfig:
    """``algo=grpo``: one step = batch_size tasks x group_size rollouts, then one update (agl/train/grpo.py)."""

    name: str = doc("grpo", ALGO_NAME)
    steps: int = doc(30, "GRPO steps; the yaml: the task's recipe.steps, else 30")
    batch_size: int = doc(4, "B: tasks per step")
    group_size: int = doc(8, "G: rollouts per task, compared with each other")
    lr: float = doc(2e-4, "AdamW learning rate")
    loss: dict[str, Any] = doc(
        {"type": "dapo"},
        "the policy loss: type (a registered loss: grpo | dr_grpo | dapo | gspo | cispo | sapo | opmd, or "
        "module:function) and that loss's parameters, e.g. algo.loss.type=sapo algo.loss.tau_pos=1.0 "
        '(docs/algorithms.md "Losses")',
        open_keys=True,
    )
    advantage: str = doc(
        "grpo",
        "the advantage estimator: grpo | grpo_batch | dr_grpo | rloo, or module:function "
        '(docs/algorithms.md "Advantages")',
    )
    beta: float = doc(0.0, "KL weight against the base model (adapter off); 0 skips the reference pass")
    num_iterations: int = doc(1, "mu: optimizer passes over each batch")
    old_logprobs: str = doc(
        "recorded", "recorded (sampling-time, from spans) | recompute (trainer forward before step)"
    )
    micro_batch_size: Optional[int] = doc(
        None, "rows per forward/backward pass at most (None: only micro_batch_tokens bounds them)"
    )
    micro_batch_tokens: Optional[int] = doc(
        2048, "tokens per pass at most, padding included (plan_micro_batches); None: no cap"
    )
    gradient_checkpointing: bool = doc(
        True,
        "replay each decoder layer in backward instead of keeping its activations "
        "(agl/train/activation_checkpointing.py)",
    )
    max_grad_norm: float = doc(1.0, "gradients are clipped to this global norm")
    mask_truncated: bool = doc(False, "true: completions cut by max_tokens carry no loss")
    drop_zero_std: bool = doc(True, "skip groups whose rewards are all equal: they teach nothing")
    dynamic_sampling: bool = doc(
        False,
        "DAPO's dynamic sampling: while fewer than batch_size groups have unequal rewards, draw more tasks (up to "
        "max_extra_groups), then train on the first batch_size that do (agl/train/sampling.py). The yaml: the "
        "task's recipe.dynamic_sampling, else false",
    )
    max_extra_groups: int = doc(12, "dynamic_sampling: tasks a step may draw beyond batch_size at most")
    weight_decay: float = doc(0.0, "AdamW weight decay")
    temperature: float = doc(0.8, "sampling temperature of the rollouts")
    top_p: float = doc(1.0, "nucleus sampling of the rollouts; 1.0: off")
    max_tokens: int = doc(128, "per LLM call of a rollout; the yaml: ${task.max_tokens}")
    eval_every: int = doc(15, "steps (the yaml: task.recipe's, else 15); also at step 0 and at the end")
    warmup: SFTConfig = doc(SFTConfig(steps=0), "algo.warmup.*: an SFT stage first (algo=sft's keys); steps=0: none")

    @classmethod
    def from_cfg(cls, cfg: Any) -> GRPOConfig:
        """The update's keys of ``cfg`` (a composed ``algo``, or any mapping); the rest take their defaults."""
        names = {f.name for f in dataclasses.fields(cls)} - {"warmup"}
        return cls(**{k: v for k, v in dict(cfg).items() if k in names})


@algorithm
class EvalConfig:
    """``algo=eval`` (agl/jobs/eval.py)."""

    name: str = doc("eval", ALGO_NAME)
    split: str = doc("test", "the split it evaluates on; the yaml: ${task.eval_split}")
    size: int = doc(16, "the first N tasks of the split; 0 = all. The yaml: ${task.eval_size}")
    prompt: str = doc("default", "which of task.prompts the agent gets. The yaml: ${task.prompt}")
    k: int = doc(1, "tries per task; pass@k is reported when k > 1")
    temperature: float = doc(0.0, "0 = greedy; sample (e.g. 0.8) when k > 1, or every try is the same")
    top_p: float = doc(1.0, "nucleus sampling; 1.0: off")
    max_tokens: int = doc(128, "per LLM call; the yaml: ${task.max_tokens}")
    pass_threshold: float = doc(1.0, "a try passes when its reward is >= this")


@algorithm
class PromptSearchConfig:
    """``algo=prompt_search`` (agl/jobs/prompt_search.py): score each prompt template on the same tasks, rank them."""

    name: str = doc("prompt_search", ALGO_NAME)
    split: str = doc("train", "choose on train, confirm the winner with algo=eval. The yaml: ${task.train_split}")
    size: int = doc(32, "distinct tasks per candidate (the first N of the split)")
    candidates: Optional[list[str]] = doc(None, "names from task.prompts; None: all of them")
    temperature: float = doc(0.0, "0 = greedy: the template, not sampling noise, makes the difference")
    top_p: float = doc(1.0, "nucleus sampling; 1.0: off")
    max_tokens: int = doc(128, "per LLM call; the yaml: ${task.max_tokens}")
    bootstrap: int = doc(2000, "resamples for the bootstrap 95% interval")


@algorithm
class CustomConfig:
    """``algo=custom`` (agl/jobs/custom.py): the user's own ``async def`` on the run's store, runners and route."""

    name: str = doc("custom", ALGO_NAME)
    fn: Optional[str] = doc(None, "required: module:function")
    args: dict[str, Any] = doc(
        {}, "keyword arguments for fn, checked against its signature, e.g. algo.args.tasks_per_prompt=8", open_keys=True
    )
    temperature: float = doc(0.0, 'for rollouts whose metadata has no "sampling"; 0 = greedy')
    top_p: float = doc(1.0, 'for rollouts whose metadata has no "sampling"; 1.0: off')
    max_tokens: int = doc(128, "per LLM call; the yaml: ${task.max_tokens}")


@algorithm
class ServeConfig:
    """``algo=serve`` (agl/jobs/serve.py): the policy on the route until Ctrl-C; ``server.*`` sets where it listens."""

    name: str = doc("serve", ALGO_NAME)
    record: bool = doc(True, "every call into the run dir's store.sqlite (token ids, logprobs, request)")


@algorithm
class ExportConfig:
    """``algo=export`` (agl/jobs/export.py): model.adapter merged into the full-precision base, as HF and GGUF."""

    name: str = doc("export", ALGO_NAME)
    dtype: str = doc("float32", "float32 | bfloat16 | float16: the exported weights (the merge itself is in float32)")
    out: Optional[str] = doc(
        None, "where to write hf/ and model-<dtype>.gguf; None: export/ in the run dir. Must not hold files yet"
    )
    gguf: bool = doc(True, "false: the HF dir only")


@algorithm
class RunnerJobConfig:
    """``algo=runner attach=<run dir>`` or ``algo=runner store.url=<url>`` (agl/agents/attach.py): join a running
    job; ``runner.n`` sets how many rollouts at once."""

    name: str = doc("runner", ALGO_NAME)
    route_url: Optional[str] = doc(
        None,
        "store.url: the job's route as this host reaches it (http://host:port); null: the URL the job published",
    )


@algorithm
class StoreJobConfig:
    """``algo=store`` (agl/jobs/store.py): the run dir's store served over HTTP on ``store.host:store.port``
    until Ctrl-C, for jobs, runners and algorithms that join by ``store.url``."""

    name: str = doc("store", ALGO_NAME)


@algorithm
class InfoConfig:
    """``algo=info`` (agl/jobs/dispatch.py): load the model, print parameter counts and memory, exit."""

    name: str = doc("info", ALGO_NAME)


SCHEMAS: dict[tuple[str | None, str], type] = {
    (None, "config_schema"): Config,
    ("model", "model_schema"): ModelConfig,
    ("task", "task_schema"): TaskConfig,
    **{("algo", f"{name}_schema"): schema for name, schema in ALGO_SCHEMAS.items()},
}


SCHEMA_NAMES = {
    cls.__name__
    for cls in (
        *SCHEMAS.values(),
        RunnerConfig,
        EngineConfig,
        ServerConfig,
        StoreConfig,
        EvalCacheConfig,
        LoraConfig,
        TinyConfig,
    )
}


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent): conf/ names them in its defaults lists."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for (group, name), schema in SCHEMAS.items():
        store.store(group=group, name=name, node=with_open_keys(OmegaConf.structured(schema)))


def with_open_keys(node: DictConfig) -> DictConfig:
    """``node`` with its ``open_keys`` mappings (``doc(..., open_keys=True)``) out of struct mode, at any depth: Hydra
    then takes ``algo.loss.tau_pos=1.0`` without a ``+``, as if the key were in the schema."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return node
    for f in dataclasses.fields(schema):
        child = node._get_node(f.name)
        if f.metadata.get("open_keys") and isinstance(child, DictConfig):
            OmegaConf.set_struct(child, False)
        elif isinstance(child, DictConfig):
            with_open_keys(child)
    return node


def with_schema(saved: DictConfig) -> DictConfig:
    """A config saved by an earlier run, on the schemas: keys added since then take their defaults.

    The top level, ``model``, and ``algo`` when its name is one of agl's (``ALGO_SCHEMAS``).
    Keys the schemas no longer know are kept (an old run's config is what it ran with).
    """
    out = OmegaConf.merge(_defaults(Config), saved)
    if "model" in saved:
        out.model = OmegaConf.merge(_defaults(ModelConfig), saved.model)
    algo_schema = ALGO_SCHEMAS.get(str(OmegaConf.select(saved, "algo.name")))
    if algo_schema is not None:
        out.algo = OmegaConf.merge(_defaults(algo_schema), saved.algo)
    return out


def typed(schema: type, cfg: Any) -> Any:
    """``cfg`` (a composed section, or a partial one: a test's dict, an older run's) on its schema, so
    every key it lacks reads the default from here and a wrong type fails. Components call this on the
    section they are given instead of ``cfg.get(key, default)``; an instance of ``schema`` is returned as is."""
    if isinstance(cfg, schema) or OmegaConf.get_type(cfg) is schema:
        return cfg
    if isinstance(cfg, DictConfig):  # interpolations resolve against the section's own root (``${task.max_tokens}``)
        cfg = OmegaConf.to_container(cfg, resolve=True)
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), cfg)
    except OmegaConfBaseException as error:
        raise ConfigError(
            f"{error.full_key or schema.__name__}: "
            f"{str(getattr(error, 'msg', error)).splitlines()[0]} ({schema.__name__})"
        ) from None


def _defaults(schema: type) -> DictConfig:
    """``schema``'s defaults as a plain (untyped) config: merged under a saved one, it adds keys and checks nothing."""
    return OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(schema)))


def to_typed(cfg: Any) -> Config:
    """The one conversion from the Hydra config, at a job's edge: ``cfg`` (composed, or any mapping of it)
    as the schemas' dataclasses, every section typed. Below the jobs, components take their sections
    (``RunnerConfig``, ``GRPOConfig``, ...), never the whole Hydra config.

    ``algo`` takes the schema its name has (``ALGO_SCHEMAS``); a task's keys outside ``TaskConfig`` are left
    out (agl reads none of them; a task yaml of the user's own need not list ``task_schema``), and so are
    top-level keys outside ``Config`` (``agl.run`` passes its ``run_dir`` that way).
    """
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = dict(cfg)
    task = cfg.get("task") or {}
    known = {f.name for f in dataclasses.fields(TaskConfig)}
    sections = {
        "model": typed(ModelConfig, cfg.get("model") or {}),
        "task": typed(TaskConfig, {k: v for k, v in task.items() if k in known}),
        "algo": typed(ALGO_SCHEMAS.get((cfg.get("algo") or {}).get("name"), InfoConfig), cfg.get("algo") or {}),
    }
    fields = {f.name for f in dataclasses.fields(Config)}  # a key no schema has (agl.run's run_dir) is not config
    top = typed(Config, {k: v for k, v in cfg.items() if k in fields and k not in sections})
    return OmegaConf.to_object(OmegaConf.merge(top, sections))


def plain(section: Any) -> Any:
    """A config or section (a dataclass, a DictConfig or a mapping) as plain JSON-ready data."""
    if dataclasses.is_dataclass(section) and not isinstance(section, type):
        return dataclasses.asdict(section)
    if isinstance(section, (DictConfig, ListConfig)):
        return OmegaConf.to_container(section, resolve=True)
    return dict(section) if isinstance(section, Mapping) else section


def config_record(config: Config) -> dict:
    """``config`` as plain data: what a run records of the config it ran with (``run_info['config']``)."""
    return plain(config)
