"""task=gsm8k_json: GSM8K answered as JSON under a strict schema (tasks/gsm8k_json)."""

from __future__ import annotations

import json
import sqlite3

import jsonschema
from conftest import run_harness

from tasks.gsm8k.data import load_split
from tasks.gsm8k_json.agent import answer_schema, demonstration, parse


def test_every_demonstration_follows_the_schema_and_keeps_the_gold_answer():
    schema = answer_schema(1200)
    validator = jsonschema.validators.validator_for(schema)(schema)  # jsonschema.validate checks the schema each call
    validator.check_schema(schema)
    for split in ("train", "test"):
        for row in load_split(split):
            reply = json.loads(demonstration(row))
            validator.validate(reply)
            assert str(reply["answer"]) == row["gold"]
    assert parse('{"reasoning": "cut') is None and parse("[1]") is None


def test_a_short_grpo_run_trains_through_structure(tmp_path):
    """The whole job on the tiny model: every reply is sampled under the schema's grammar, ends well
    formed (reasoning capped at 3 characters so the random model finishes), and the update's log-probs
    agree with the sampler's masked ones."""
    result = run_harness(
        "model=tiny",
        "task=gsm8k_json",
        "algo=grpo",
        "algo.warmup.steps=0",
        "algo.steps=1",
        "algo.batch_size=2",
        "algo.group_size=2",
        "algo.eval_every=0",
        "algo.drop_zero_std=false",
        "task.eval_size=2",
        "task.final_eval_size=null",
        "task.max_tokens=40",
        "task.resources.reasoning_max_chars=3",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    db = sqlite3.connect(tmp_path / "run" / "store.sqlite")
    spans = [json.loads(a) for (a,) in db.execute("SELECT attributes FROM spans WHERE name = 'llm.chat'")]
    assert spans and all(s["constraint"]["kind"] == "json_schema" for s in spans)
    for span in spans:
        assert span["finish_reason"] == "stop"
        jsonschema.validate(json.loads(span["response_text"]), answer_schema(3))
    [update] = [
        row
        for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "logprob_diff_abs" in row
    ]
    assert update["constrained_tokens"] > 0 and update["logprob_diff_abs"] < 1e-4, update
