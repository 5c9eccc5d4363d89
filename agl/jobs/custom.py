"""``algo=custom``: your own algorithm, an async function, on the run's store, runners and route.

    python harness.py task=hello algo=custom algo.fn=my_algo:find_best_prompt

agent-lightning's "write your first algorithm" without a store server and a runner process:
the harness starts the store, the policy, the route and ``runner.n`` runners
(``agl.runtime.Runtime``), calls the function, and stops them all when it returns. The function
works through the store with agent-lightning v0.2's names (``agl.store.SqliteStore``):
``add_resources``, ``enqueue_rollout(input=..., resources_id=...)``, ``wait_for_rollouts``,
``get_rollout_by_id``, ``query_spans``; the runners run the task's agent on every rollout it
enqueues, with the resources it names as the agent's keyword arguments.

The contract:
  * ``algo.fn`` is ``module:function``, imported like ``task.agent`` (from the current directory
    or PYTHONPATH), and the function is ``async def``.
  * Its parameters are matched by name. agl passes the ones it declares among ``PROVIDED``:
      store      the run's store
      task       the ``agl.agents.tasks.Task``: ``agent``, ``prompts``, ``resources_for(prompt)``, ``load(split)``
      rows       the rows of ``task.train_split``
      eval_rows  the first ``task.eval_size`` rows of ``task.eval_split`` (all of them when 0)
      cfg        the run's typed config (``agl.config.Config``: ``cfg.task.train_split``, ``cfg.algo.args``, ...)
      llm        an ``agl.LLM`` on the route outside any rollout: the policy for the algorithm's own
                 calls (served, not recorded)
      runtime    the ``Runtime``: ``policy``, ``engine``, ``run_rollouts(...)``, ``resources_id(...)``
      run_dir    the run's directory, for the function's own files
    and every key of ``algo.args`` (``algo.args.name=value``), converted to the type its parameter is
    annotated with (pydantic's rules: ``k: int`` takes 8, not "eight"); a ``**kwargs`` parameter gets all of
    them. A required parameter that is neither, an ``algo.args`` key the function does not take,
    or a missing, unimportable or non-async ``algo.fn`` is a ConfigError before the model loads.
  * A rollout whose metadata has no ``"sampling"`` is decoded with ``algo.temperature``,
    ``algo.top_p`` and ``algo.max_tokens`` (its agent gets them as ``llm.sampling_parameters``).
  * The return value, made JSON-safe (pydantic models and dataclasses dumped, anything else unknown
    as its string), is the job's result: ``status.json``'s ``result``, what ``agl.run`` returns, and
    the result row of ``report=``. A dict's ``metrics`` ({name: number}) show in sweep summaries.
  * An exception fails the job, its traceback in ``error.log``, as in every job.

Left out: resuming. A resumed run calls the function again on the same store (the rollouts of the
earlier call are there to read); only the function knows which of its work is done.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python

from agl.agents.api import LLM
from agl.agents.tasks import import_object
from agl.config import Config, CustomConfig, client_api_key, plain
from agl.errors import ConfigError
from agl.eval.evaluate import sampling_of, split_rows
from agl.runtime import Runtime

# What agl passes, by parameter name; each is made only when the function asks for it.
PROVIDED: dict[str, Callable[[Runtime], Any]] = {
    "store": lambda rt: rt.store,
    "task": lambda rt: rt.task,
    "rows": lambda rt: rt.task.load(rt.task_config.train_split),
    "eval_rows": lambda rt: split_rows(rt.task.load(rt.task_config.eval_split), rt.task_config.eval_size),
    "cfg": lambda rt: rt.config,
    "llm": lambda rt: LLM(
        base_url=rt.server.base_url,
        model=rt.policy.name,
        api_key=client_api_key(rt.server_config),
        sampling_parameters=sampling_of(rt.config.algo),
    ),
    "runtime": lambda rt: rt,
    "run_dir": lambda rt: rt.run_dir,
}


def load_algorithm(algo: CustomConfig) -> tuple[Callable, list[str]]:
    """``algo.fn`` -> the function and the names in ``PROVIDED`` it takes (see the module docstring)."""
    if not algo.fn:
        raise ConfigError(
            'algo=custom needs algo.fn=module:function, an async function (see docs/algorithms.md "Your own algorithm")'
        )
    spec = str(algo.fn)
    fn = import_object(spec)
    if not inspect.iscoroutinefunction(fn):
        what = (
            "it is not async (define it with async def)"
            if callable(fn)
            else f"it is a {type(fn).__name__}, not a function"
        )
        raise ConfigError(f"algo.fn '{spec}' must be an async function: {what}")
    args = list(algo.args)
    if taken := [a for a in args if a in PROVIDED]:
        raise ConfigError(f"algo.args {taken} are passed by agl; remove them from algo.args")
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if positional_only := [n for n, p in params.items() if p.kind is p.POSITIONAL_ONLY]:
        raise ConfigError(
            f"algo.fn '{spec}': parameters are passed by name, so {positional_only} cannot be positional-only"
        )
    if not takes_all and (unused := [a for a in args if a not in params]):
        raise ConfigError(
            f"algo.args {unused} are not parameters of '{spec}' (it takes: {', '.join(params) or 'none'})"
        )
    required = [
        n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.default is p.empty
    ]
    if missing := [n for n in required if n not in PROVIDED and n not in args]:
        raise ConfigError(
            f"algo.fn '{spec}' needs {missing}: agl passes only {', '.join(PROVIDED)}; "
            f"give the others in algo.args, e.g. algo.args.{missing[0]}=..."
        )
    return fn, list(PROVIDED) if takes_all else [n for n in params if n in PROVIDED]


class CustomRuntime(Runtime):
    """The Runtime with ``algo``'s decoding for rollouts enqueued without their own, and the whole typed
    config (the function may ask for it as ``cfg``)."""

    config: Config

    def default_sampling(self) -> dict:
        return sampling_of(self.config.algo)


def typed_args(fn: Callable, args: dict[str, Any]) -> dict[str, Any]:
    """``algo.args`` as the types ``fn`` annotates its parameters with; a value that does not fit is a ConfigError
    naming the key. Unannotated parameters, and those ``**kwargs`` takes, get the values as the config has them."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: the values go as they are
        hints = {}
    out = {}
    for name, value in args.items():
        try:
            out[name] = TypeAdapter(hints[name]).validate_python(value) if name in hints else value
        except ValidationError as error:
            raise ConfigError(f"algo.args.{name}={value!r}: {error.errors()[0]['msg']} ({hints[name]})") from None
    return out


async def run_custom(config: Config, run_dir: Path) -> Any:
    algo: CustomConfig = config.algo
    fn, provided = load_algorithm(algo)
    args = typed_args(fn, plain(algo.args))
    runtime = CustomRuntime.of(config, run_dir)
    runtime.config = config
    async with runtime as rt:
        await rt.record_config()
        result = await fn(**{name: PROVIDED[name](rt) for name in provided}, **args)
    result = to_jsonable_python(result, fallback=str)
    print(f"result of {algo.fn} (also in {run_dir / 'status.json'}):\n{json.dumps(result, indent=1)}")
    return result


def run(config: Config, run_dir: Path) -> object:
    """``algo=custom``: what ``agl.jobs.dispatch`` calls."""
    return asyncio.run(run_custom(config, run_dir))
