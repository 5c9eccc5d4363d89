"""The eval cache (agl/eval/cache.py): keyed by what decides a greedy eval, reused across jobs, safe to kill,
to damage and to share between parallel jobs. Tiny model, real store, route and runners."""

import asyncio
import json
import logging
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest
import runs
import torch
from helpers import typed_cfg

from agl.config import EvalCacheConfig
from agl.eval.cache import (
    EvalCache,
    adapter_digest,
    code_digest,
    row_key,
    source_digest,
    weights_digest,
)
from agl.jobs.eval import run_eval
from agl.jobs.grpo import train
from agl.policy.load import load_policy
from agl.report.run_report import report_run

ROOT = Path(__file__).resolve().parents[1]
VOWELS = [
    "model=tiny",
    "progress=false",
    "runner.n=8",
    "task=hello",
    "task.agent=crash_points:multi_turn_agent",
    "task.data=e2e_agents:load",
    "task.max_tokens=6",
    "+task.resources.max_turns=2",
]
EVAL = VOWELS + ["algo=eval", "task.eval_size=0"]  # all 16 tasks


def attempts(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / "store.sqlite") as conn:
        return conn.execute("SELECT count(*) FROM attempts").fetchone()[0]


def rows_of(cache: Path) -> dict[str, bytes]:
    """Every row file of every entry under ``cache``: {entry/row: bytes}."""
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.glob("*/*/rows/*.json"))}


# ----------------------------------------------------------------------------- the key


COMPONENTS = {
    "weights": "w0",
    "adapter": None,
    "task": "hello",
    "agent": "a0",
    "resources": {"prompt_template": "{question}", "identity": "Lightning"},
    "decoding": {"temperature": 0.0, "max_tokens": 48},
    "numerics": {
        "compute_dtype": "float32",
        "quantization": "nf4",
        "double_quant": False,
        "batch_invariant": True,
        "engine_weights": "merged",
        "decode": "fast",
        "device": "cpu:AVX512",
    },
    "code": "c0",
}
CHANGES = {
    "weights": "w1",
    "adapter": "a1b2",
    "task": "gsm8k",
    "agent": "a1",
    "resources": {"prompt_template": "Q: {question}", "identity": "Lightning"},
    "decoding": {"temperature": 0.0, "max_tokens": 64},
    "code": "c1",
    **{
        f"numerics.{name}": value
        for name, value in {
            "compute_dtype": "bfloat16",
            "quantization": "none",
            "double_quant": True,
            "batch_invariant": False,
            "engine_weights": "adapter",
            "decode": "model",
            "device": "cpu:AVX2",
        }.items()
    },
}


def test_every_component_of_the_key_changes_it(tmp_path):
    cache = EvalCache(EvalCacheConfig(dir=str(tmp_path)))
    keys = {"base": cache.entry(COMPONENTS).key}
    for name, value in CHANGES.items():
        changed = json.loads(json.dumps(COMPONENTS))
        section, _, field = name.partition(".")
        if field:
            changed[section][field] = value
        else:
            changed[section] = value
        keys[name] = cache.entry(changed).key
    assert len(set(keys.values())) == len(keys), keys
    assert cache.entry(dict(COMPONENTS)).key == keys["base"]  # and nothing else does
    # a row: its split, task id, content and try
    row = {"id": "test-1", "question": "Who?"}
    variants = [
        row_key("test", row, 0),
        row_key("train", row, 0),
        row_key("test", {**row, "id": "test-2"}, 0),
        row_key("test", {**row, "question": "Why?"}, 0),
        row_key("test", row, 1),
    ]
    assert len(set(variants)) == len(variants) and row_key("test", dict(row), 0) == variants[0]


def test_the_key_reads_each_component_from_what_the_eval_runs(tmp_path, tiny_model_cfg):
    """Weights, adapter, agent source and agl's code: each digest follows what it describes."""
    # weights: the model cache's manifest, or the files themselves
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"\0" * 64)
    first = weights_digest.__wrapped__(str(plain))
    (plain / "model.safetensors").write_bytes(b"\1" + b"\0" * 63)
    assert weights_digest.__wrapped__(str(plain)) != first
    assert weights_digest.__wrapped__("org/model") == "hub:org/model"
    # the adapter: none while the LoRA adds nothing (a fresh one, whatever its seed), else its weights
    policy = load_policy(tiny_model_cfg, "cpu")
    assert adapter_digest(policy.model) is None
    lora_a = next(p for n, p in policy.model.named_parameters() if "lora_A" in n)
    with torch.no_grad():
        lora_a.add_(1.0)  # A changes, B is still zero: the LoRA still adds nothing
    assert adapter_digest(policy.model) is None
    lora_b = next(p for n, p in policy.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b[0, 0] = 1e-3
    trained = adapter_digest(policy.model)
    with torch.no_grad():
        lora_b[0, 0] = 2e-3
    assert None is not trained != adapter_digest(policy.model)
    # the agent's source: its module, or its package's modules
    agent = tmp_path / "agent_pkg"
    agent.mkdir()
    (agent / "__init__.py").write_text("")
    (agent / "agent.py").write_text("def run():\n    return 1\n")
    (agent / "scoring.py").write_text("X = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        from agent_pkg.agent import run

        before = source_digest(run)
        (agent / "scoring.py").write_text("X = 2\n")
        assert source_digest(run) != before
    finally:
        sys.path.remove(str(tmp_path))
    # agl's code: a copy of its sources, one file changed
    code = tmp_path / "agl"
    shutil.copytree(ROOT / "agl", code, ignore=shutil.ignore_patterns("__pycache__"))
    digest = code_digest.__wrapped__(code)
    assert digest == code_digest()  # the copy is the same code
    (code / "policy" / "decode.py").write_text((code / "policy" / "decode.py").read_text() + "\n# changed\n")
    assert code_digest.__wrapped__(code) != digest


# ----------------------------------------------------------------------------- reuse


async def test_a_second_job_replays_the_baseline_from_the_cache_and_says_so(tmp_path, capsys):
    grpo = VOWELS + [
        "algo=grpo",
        "algo.steps=1",
        "algo.batch_size=2",
        "algo.group_size=4",
        "algo.micro_batch_size=4",
        "algo.lr=3e-2",
        "algo.eval_every=0",
        "task.eval_size=6",
        "task.final_eval_size=8",
        f"eval_cache.dir={tmp_path / 'evals'}",
    ]
    await train(typed_cfg(grpo), tmp_path / "first")
    assert "from the eval cache" not in capsys.readouterr().out
    await train(typed_cfg(grpo + ["seed=1"]), tmp_path / "second")  # another seed: another LoRA, no adapter
    out = capsys.readouterr().out
    assert "eval@0: 8 of 8 rows from the eval cache (exact" in out, out
    first, second = (
        json.loads((tmp_path / r / "metrics.jsonl").read_text().splitlines()[0]) for r in ("first", "second")
    )
    assert first["step"] == second["step"] == -1
    assert {k: v for k, v in first.items() if k.startswith("eval")} == {
        k: v for k, v in second.items() if k.startswith("eval")
    }
    with sqlite3.connect(tmp_path / "second" / "store.sqlite") as conn:
        baseline = conn.execute(
            "SELECT r.rollout_id, r.status, count(a.attempt_id) "
            "FROM rollouts r LEFT JOIN attempts a USING (rollout_id) "
            "WHERE json_extract(r.metadata, '$.eval_step') = 0 GROUP BY r.rollout_id"
        ).fetchall()
    assert len(baseline) == 8 and all(status == "succeeded" and n == 0 for _, status, n in baseline)
    final = json.loads((tmp_path / "second" / "metrics.jsonl").read_text().splitlines()[-1])
    assert "eval_all/said_a_p" in final  # the paired test reads the cached baseline's per-task scores
    report = report_run(tmp_path / "second", echo=False)
    assert "rows from the eval cache" in report["sections"]
    text = (tmp_path / "second" / "report.md").read_text()
    assert "| eval@0 | 8    | 8" in text and "samples: the same eval tasks" in text


async def test_exact_reuse_only_recomputes_batched_rows(tmp_path, capsys):
    batched = EVAL + ["task.eval_size=4", "engine.batch_invariant=false", f"eval_cache.dir={tmp_path / 'evals'}"]
    first = await run_eval(typed_cfg(batched), tmp_path / "first")
    assert attempts(tmp_path / "first") == 4 and not first["cached"]
    again = await run_eval(typed_cfg(batched), tmp_path / "again")
    assert attempts(tmp_path / "again") == 0 and again["cached"] == {"sample": 4}
    assert "4 of 4 rows from the eval cache: 4 sample" in (tmp_path / "again" / "eval.md").read_text()
    exact_only = await run_eval(typed_cfg(batched + ["eval_cache.reuse=exact"]), tmp_path / "exact")
    assert attempts(tmp_path / "exact") == 4 and not exact_only["cached"]
    assert again["summary"] == first["summary"] == exact_only["summary"]


# ----------------------------------------------------------------------------- damage


async def test_a_damaged_row_or_key_is_recomputed_with_one_warning(tmp_path, caplog):
    cache = tmp_path / "evals"
    run = EVAL + [f"eval_cache.dir={cache}"]
    reference = await run_eval(typed_cfg(run), tmp_path / "reference")
    rows = rows_of(cache)
    assert len(rows) == 16
    files = sorted(cache.glob("*/*/rows/*.json"))
    files[0].write_bytes(files[0].read_bytes().replace(b'"turns":2', b'"turns":3'))  # a changed score
    files[1].write_bytes(files[1].read_bytes()[:40])  # a torn file
    with caplog.at_level(logging.WARNING, logger="agl.eval.cache"):
        again = await run_eval(typed_cfg(run), tmp_path / "again")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 row(s)" in warnings[0], warnings
    assert attempts(tmp_path / "again") == 2 and again["cached"] == {"exact": 14}
    assert again["summary"] == reference["summary"] and rows_of(cache) == rows  # recomputed as they were

    caplog.clear()
    [key_file] = cache.glob("*/*/key.json")
    key_file.write_text(key_file.read_text().replace('"hello"', '"other"'))  # a stale entry
    with caplog.at_level(logging.WARNING, logger="agl.eval.cache"):
        third = await run_eval(typed_cfg(run), tmp_path / "third")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not match its key" in warnings[0], warnings
    assert attempts(tmp_path / "third") == 16 and not third["cached"]
    assert third["summary"] == reference["summary"] and rows_of(cache) == rows


# ----------------------------------------------------------------------------- processes


def harness(run_dir: Path, cache: Path, *args: str, kill: str = "") -> runs.Output:
    """``python harness.py`` (forked: tests/prefork.py) evaluating ``EVAL`` into ``cache``."""
    return runs.harness(
        *EVAL, f"eval_cache.dir={cache}", f"hydra.run.dir={run_dir}", *args, kill=kill, env={"OMP_NUM_THREADS": "1"}
    )


@pytest.fixture(scope="module")
def reference_rows(tmp_path_factory) -> dict[str, bytes]:
    """The rows of the 16-task eval computed in one go, into a cache of its own."""
    base = tmp_path_factory.mktemp("reference")
    asyncio.run(run_eval(typed_cfg(EVAL + [f"eval_cache.dir={base / 'evals'}"]), base / "run"))
    return rows_of(base / "evals")


async def test_a_killed_eval_resumes_from_the_rows_it_kept(tmp_path, reference_rows, capsys):
    cache = tmp_path / "evals"
    killed = harness(tmp_path / "killed", cache, kill="eval_rows:5")
    out, _ = await asyncio.to_thread(killed.communicate, timeout=300)
    assert killed.returncode == -9, out[-3000:]
    assert len(rows_of(cache)) == 5  # what it had kept when it died
    capsys.readouterr()
    await run_eval(typed_cfg(EVAL + [f"eval_cache.dir={cache}"]), tmp_path / "next")  # another job: only 11 run
    assert "eval test: 5 of 16 rows from the eval cache (exact" in capsys.readouterr().out
    assert attempts(tmp_path / "next") == 11
    assert rows_of(cache) == reference_rows  # byte for byte what one uninterrupted eval keeps


def test_two_jobs_racing_for_one_entry_compute_it_once(tmp_path, reference_rows):
    cache = tmp_path / "evals"
    jobs = [harness(tmp_path / name, cache) for name in ("a", "b")]
    outs = [runs.finish(job) for job in jobs]
    # whoever came second waited for the first, or found its rows: 16 rollouts ran in all, not 32
    assert attempts(tmp_path / "a") + attempts(tmp_path / "b") == 16, [o[-1500:] for o in outs]
    assert rows_of(cache) == reference_rows and len(list(cache.glob("*/*/key.json"))) == 1
    results = [json.loads((tmp_path / name / "eval.json").read_text())["summary"] for name in ("a", "b")]
    assert results[0] == results[1]


async def test_a_cached_rollout_is_recorded_finished_in_order(store):
    rollouts = await store.enqueue_rollouts(
        [{"id": 1}, {"id": 2}, {"id": 3}], mode="val", finished=[None, "succeeded", None]
    )
    assert [r.rollout_id for r in rollouts] == ["ro-000001", "ro-000002", "ro-000003"]
    assert [str(r.status) for r in rollouts] == ["queuing", "succeeded", "queuing"]
    assert rollouts[1].end_time is not None
    taken = [await store.dequeue_rollout(), await store.dequeue_rollout(), await store.dequeue_rollout()]
    assert [t and t.rollout_id for t in taken] == ["ro-000001", "ro-000003", None]
    assert [r.rollout_id for r in await store.wait_for_rollouts(["ro-000002"], timeout=0)] == ["ro-000002"]
    with pytest.raises(ValueError, match="terminal"):
        await store.enqueue_rollouts([{"id": 4}], finished=["running"])
    assert len(await store.query_rollouts()) == 3  # all of that call or none
