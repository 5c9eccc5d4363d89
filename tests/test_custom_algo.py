"""``algo=custom`` (your own async function on the run's store, runners and route) and ``agl.run``.

On the tiny random model, with an agent whose reward the prompt template decides
(workflow_agents.marker_agent): docs/algorithms.md's find_best_prompt (tests/my_algo.py) must pick
the marked template, through ``agl.run`` (harness.py's job in this process: harness.py itself is run
by tests/test_harness.py).
"""

import json
import re
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from omegaconf import OmegaConf

import agl
import agl.notebook
from agl.config import CustomConfig, typed
from agl.errors import ConfigError
from agl.jobs.custom import PROVIDED, load_algorithm

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "progress=false", "runner.n=8", "task.max_tokens=6"]
MARKED = TINY + [
    "task=hello",
    "task.agent=workflow_agents:marker_agent",
    "+task.prompts.marked='[BEST] {question}'",
    "algo=custom",
]
FIND_BEST = MARKED + ["algo.fn=my_algo:find_best_prompt"]


def status(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def llm_sampling(run_dir: Path) -> list[dict]:
    with sqlite3.connect(run_dir / "store.sqlite") as conn:
        rows = conn.execute(
            "SELECT json_extract(attributes, '$.request.sampling') FROM spans WHERE name LIKE 'llm.%'"
        ).fetchall()
    return [json.loads(r[0]) for r in rows]


def assert_marked_wins(result: dict) -> None:
    assert result["best"] == "marked" and result["template"] == "[BEST] {question}"
    assert set(result["scores"]) == {"plain", "named", "marked"}
    assert result["scores"]["marked"] >= 0.7 > 0.3 >= max(result["scores"]["plain"], result["scores"]["named"])
    assert result["metrics"] == {"best_reward": result["scores"]["marked"]}


# ----------------------------------------------------------------------------- the harness


def test_docs_find_best_prompt_is_tests_my_algo():
    """docs/algorithms.md's own-algorithm example is tests/my_algo.py verbatim (the file the tests run)."""
    assert (ROOT / "tests" / "my_algo.py").read_text().strip() in (ROOT / "docs" / "algorithms.md").read_text()


def test_a_bad_algo_fn_fails_the_job_before_the_model_loads(tmp_path):
    """What `python harness.py ... algo.fn=workflow_agents:marker_agent` meets (the job, run in this process;
    tests/test_harness.py runs the command line's one-line error)."""
    run_dir = tmp_path / "run"
    message = (
        "algo.fn 'workflow_agents:marker_agent' must be an async function: it is not async (define it with async def)"
    )
    with pytest.raises(ConfigError) as error:
        agl.run(*MARKED, "algo.fn=workflow_agents:marker_agent", run_dir=run_dir)
    assert str(error.value) == message
    assert status(run_dir)["status"] == "failed" and status(run_dir)["error"] == f"ConfigError: {message}"
    assert not (run_dir / "store.sqlite").exists()  # refused before the model loaded


# ----------------------------------------------------------------------------- the contract


async def needs_prompts(store, prompts_to_test, task_input="Who are you?"):
    return prompts_to_test


async def takes_all(store, **everything):
    return everything


async def positional_only(store, /, rows):
    return rows


def algo(fn, **args):
    return typed(CustomConfig, {"name": "custom", "fn": fn, "args": args})


@pytest.mark.parametrize(
    "spec, args, message",
    [
        (None, {}, "algo=custom needs algo.fn=module:function"),
        ("find_best_prompt", {}, "'find_best_prompt' should look like 'package.module:function'"),
        ("no_such_module:fn", {}, "cannot import 'no_such_module:fn': No module named 'no_such_module'"),
        ("my_algo:no_such_fn", {}, "cannot import 'my_algo:no_such_fn'"),
        ("workflow_agents:marker_agent", {}, "must be an async function: it is not async"),
        ("workflow_agents:MARKER", {}, "must be an async function: it is a str, not a function"),
        ("test_custom_algo:needs_prompts", {}, "needs ['prompts_to_test']: agl passes only store, task, rows"),
        (
            "test_custom_algo:needs_prompts",
            {"prompts_to_test": [1], "task_inptu": "x"},
            "algo.args ['task_inptu'] are not parameters",
        ),
        (
            "test_custom_algo:needs_prompts",
            {"prompts_to_test": [1], "store": 1},
            "algo.args ['store'] are passed by agl",
        ),
        ("test_custom_algo:positional_only", {}, "so ['store'] cannot be positional-only"),
    ],
)
def test_bad_algo_fn_is_a_config_error(spec, args, message):
    with pytest.raises(ConfigError) as error:
        load_algorithm(algo(spec, **args))
    assert message in str(error.value)


def test_parameters_are_matched_by_name():
    fn, provided = load_algorithm(algo("my_algo:find_best_prompt"))
    assert fn.__name__ == "find_best_prompt" and provided == [
        "store",
        "task",
        "rows",
    ]  # tasks_per_prompt keeps its default
    assert load_algorithm(algo("test_custom_algo:needs_prompts", prompts_to_test=["a"]))[1] == ["store"]
    assert load_algorithm(algo("test_custom_algo:takes_all", anything=1))[1] == list(
        PROVIDED
    )  # **kwargs: all, and any args


# ----------------------------------------------------------------------------- agl.run


async def test_agl_run_inside_a_running_loop_runs_the_readme_algorithm_and_report_reads_its_run(tmp_path, capsys):
    """The `python harness.py task=hello algo=custom algo.fn=my_algo:find_best_prompt` of docs/algorithms.md, as a
    notebook runs it: its kernel runs an event loop, so the job (which starts its own) runs in a thread."""
    run_dir = tmp_path / "run"
    result = agl.run(*FIND_BEST, run_dir=run_dir)
    assert_marked_wins(result)
    assert "[algo] best prompt: marked" in capsys.readouterr().out
    record = status(run_dir)
    assert record["status"] == "succeeded" and record["algo"] == "custom" and record["error"] is None
    assert record["result"] == result
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")  # what `harness.py resume=` reads
    assert saved.algo.fn == "my_algo:find_best_prompt" and saved.task.prompts.marked == "[BEST] {question}"
    assert OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")) == FIND_BEST
    assert agl.run(*FIND_BEST, run_dir=run_dir) == result  # a succeeded run dir is not run again
    # 3 templates x 4 tasks, each under its own resources version, decoded with algo's defaults
    # (greedy, task.max_tokens): find_best_prompt enqueues them without any sampling settings
    with sqlite3.connect(run_dir / "store.sqlite") as conn:
        assert conn.execute(
            "SELECT count(*), count(DISTINCT resources_id) FROM rollouts WHERE status = 'succeeded'"
        ).fetchone() == (12, 3)
    assert [(s["temperature"], s["max_tokens"]) for s in llm_sampling(run_dir)] == [(0.0, 6)] * 12

    capsys.readouterr()
    agl.run(f"report={run_dir}")  # what `python harness.py report=<run dir>` prints
    report = capsys.readouterr().out
    assert re.search(r"\| algo\s+\| custom \(my_algo:find_best_prompt\)", report), report
    assert '"best": "marked"' in report and "12 succeeded" in report
    assert "| steps" not in report  # no checkpoints is not "no checkpoint yet" for a custom job


async def probe(store, llm, cfg, run_dir, eval_rows, runtime, greeting, **rest):
    """Uses what agl passes: the policy through the unrecorded route, and one rollout with its own decoding."""
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": greeting}], **llm.sampling_parameters
    )
    await store.add_resources(
        {"prompt_template": "[BEST] {question}"}
    )  # the latest: rollouts without resources_id get it
    rollout = await store.enqueue_rollout(
        input=eval_rows[0], metadata={"sampling": {"max_tokens": 2, "temperature": 0.0}}
    )
    [done] = await store.wait_for_rollouts([rollout.rollout_id])
    return {
        "rest": sorted(rest),
        "run_dir": str(run_dir),
        "eval_rows": [r["id"] for r in eval_rows],
        "algo": cfg.algo.name,
        "same_store": runtime.store is store,
        "reply_tokens": reply.usage.completion_tokens,
        "status": done.status,
        "rollout": done,  # a pydantic model: the result is made JSON-safe
    }


def test_agl_run_passes_what_the_function_asks_for(tmp_path):
    run_dir = tmp_path / "run"
    result = agl.run(
        *MARKED, "algo.fn=test_custom_algo:probe", "algo.args.greeting=hi", "task.eval_size=3", run_dir=run_dir
    )
    assert result["rest"] == ["rows", "task"]  # **rest: what agl passes and the named parameters did not take
    assert (
        result["run_dir"] == str(run_dir)
        and result["eval_rows"] == ["test-0", "test-1", "test-2"]
        and result["algo"] == "custom"
    )
    assert result["same_store"] is True and 1 <= result["reply_tokens"] <= 6  # llm.sampling_parameters: task.max_tokens
    assert (
        result["status"] == "succeeded"
        and result["rollout"]["rollout_id"]
        and result["rollout"]["status"] == "succeeded"
    )
    assert [s["max_tokens"] for s in llm_sampling(run_dir)] == [
        2
    ]  # its own decoding won; the unscoped call is not recorded
    assert status(run_dir)["result"] == result


def test_agl_run_picks_harness_run_dirs_and_records_failures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clock = {"%Y-%m-%d": "2030-01-02", "%H-%M-%S": "03-04-05"}  # both runs in the same second
    monkeypatch.setattr(agl.notebook, "time", SimpleNamespace(strftime=clock.__getitem__))
    for _ in range(2):
        with pytest.raises(ConfigError, match="algo=custom needs algo.fn"):
            agl.run("task=hello", "algo=custom")
    runs = sorted((tmp_path / "outputs").glob("*/*"))
    assert [str(p.relative_to(tmp_path)) for p in runs] == [
        "outputs/2030-01-02/03-04-05_hello_custom",
        "outputs/2030-01-02/03-04-05_hello_custom-1",
    ]
    for run_dir in runs:  # the second did not resume the first: each failed on its own
        assert status(run_dir)["status"] == "failed" and "algo.fn" in status(run_dir)["error"]
        assert (run_dir / "error.log").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()


def test_import_agl_stays_light():
    code = "import sys, agl; print(sorted(m for m in ('torch', 'hydra', 'agl.jobs.dispatch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
