"""docs/store.md, "Looking into a run's store": the ``sqlite-utils`` commands there, run as written (the CLI, in a
subprocess: the CLI is what the page documents) on the reference run's store, each checked against what the page
says it shows. The commands are read from the page, so the page and this test cannot drift apart."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from runs import ROLLOUTS_PER_STEP, query

DOCS = Path(__file__).resolve().parents[1] / "docs" / "store.md"
SECTION = "## Looking into a run's store"
# the installed CLI of this venv (the `inspect` extra: make setup installs it; missing, the test fails)
SQLITE_UTILS = Path(sys.executable).with_name("sqlite-utils")
TABLES = {"sessions", "resources", "rollouts", "attempts", "spans", "run_info", "checkpoints", "checkpoint_blobs"}
ROUNDED = 5e-4 + 1e-12  # the page's queries round to 3 decimals: half a unit off at most (0.1875 shows 0.188)
STATUSES = {"queuing", "preparing", "running", "succeeded", "failed", "requeuing", "cancelled"}


def documented_commands() -> dict[str, list[str]]:
    """``{label: argv}``: each ``sqlite-utils`` line in the section's bash blocks, under the ``# label`` line
    before it."""
    text = DOCS.read_text()
    section = text[text.index(SECTION) + len(SECTION) :]
    section = section.split("\n## ", 1)[0]
    commands, label = {}, None
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.splitlines():
            if line.startswith("# "):
                label = line[2:].strip()
            elif line.startswith("sqlite-utils "):
                assert label and label not in commands, f"each command needs a label of its own: {line}"
                commands[label] = shlex.split(line)
                label = None
    return commands


def run_documented(label: str, run_dir: Path) -> list[dict[str, str]]:
    """The page's command ``label``, from the run dir, its table (``-t``) parsed into rows."""
    argv = documented_commands()[label]
    assert "-t" in argv, f"{label}: the page shows tables (-t)"
    proc = subprocess.run([str(SQLITE_UTILS), *argv[1:]], cwd=run_dir, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return parse_table(proc.stdout)


def parse_table(text: str) -> list[dict[str, str]]:
    """A tabulate "simple" table: a header, a rule of dashes whose runs give the columns, then the rows."""
    header, rule, *rows = text.rstrip("\n").splitlines()
    spans = [m.span() for m in re.finditer(r"-+", rule)]
    cells = lambda line: [line[a:b].strip() for a, b in spans]
    names = cells(header)
    return [dict(zip(names, cells(row.ljust(len(rule))))) for row in rows]


def test_the_page_documents_each_promised_command():
    assert set(documented_commands()) == {
        "tables with counts",
        "rollouts by status",
        "one rollout's spans",
        "rewards per step",
        "eval reward per step",
    }


def test_tables_with_counts(reference):
    counts = {row["table"]: int(row["count"]) for row in run_documented("tables with counts", reference)}
    assert TABLES <= set(counts)
    for table, n in counts.items():
        assert n == query(reference, f"SELECT count(*) FROM {table}")[0][0], table
    assert all(counts[t] > 0 for t in ("rollouts", "attempts", "spans", "checkpoints", "metrics"))


def test_rollouts_by_status(reference):
    rows = run_documented("rollouts by status", reference)
    shown = {(r["mode"], r["status"]): int(r["rollouts"]) for r in rows}
    assert shown == {
        (m, s): n for m, s, n in query(reference, "SELECT mode, status, count(*) FROM rollouts GROUP BY 1, 2")
    }
    assert {s for _, s in shown} <= STATUSES
    # the reference run: every rollout succeeded, training ones (steps x group) and evals ("val")
    assert shown[("train", "succeeded")] == 2 * ROLLOUTS_PER_STEP and shown[("val", "succeeded")] > 0


def test_one_rollouts_spans(reference):
    rows = run_documented("one rollout's spans", reference)
    assert [int(r["sequence_id"]) for r in rows] == list(range(1, len(rows) + 1))
    calls = [r for r in rows if r["name"] == "llm.chat"]
    assert len(calls) == 2  # the multi-turn agent: two turns
    assert all(int(r["prompt_tokens"]) > 0 and int(r["response_tokens"]) > 0 for r in calls)
    assert int(calls[1]["prompt_tokens"]) > int(calls[0]["prompt_tokens"])  # the second turn extends the first
    assert {r["metric"] for r in rows if r["name"] == "metric"} == {"turns", "said_a"}
    (reward,) = [r for r in rows if r["name"] == "reward"]
    assert rows[-1] is reward
    expected = query(reference, "SELECT reward FROM rollout_rewards WHERE rollout_id = 'ro-000001'")[0][0]
    assert float(reward["value"]) == pytest.approx(expected, abs=ROUNDED)


def test_rewards_per_step(reference):
    rows = run_documented("rewards per step", reference)
    assert [int(r["step"]) for r in rows] == [1, 2]  # the GRPO steps (step 0 is the SFT warm-up: no rollouts)
    for row in rows:
        step = int(row["step"])
        assert int(row["rollouts"]) == int(row["succeeded"]) == ROLLOUTS_PER_STEP and int(row["failed"]) == 0
        mean, low, high = query(
            reference, f"SELECT avg(reward), min(reward), max(reward) FROM rollout_rewards WHERE step = {step}"
        )[0]
        assert float(row["mean_reward"]) == pytest.approx(mean, abs=ROUNDED)
        assert float(row["min_reward"]) <= float(row["mean_reward"]) <= float(row["max_reward"])
        assert (float(row["min_reward"]), float(row["max_reward"])) == pytest.approx((low, high), abs=ROUNDED)


def test_eval_reward_per_step(reference):
    rows = run_documented("eval reward per step", reference)
    shown = {(int(r["step"]), r["name"]): float(r["value"]) for r in rows}
    stored = query(reference, "SELECT step, name, value FROM metrics WHERE name IN ('eval/reward', 'eval_all/reward')")
    assert shown == pytest.approx({(s, n): v for s, n, v in stored}, abs=ROUNDED)
    # the baseline (step -1) and the final eval on the larger set, the periodic evals on the smaller one
    assert {(-1, "eval_all/reward"), (2, "eval_all/reward"), (-1, "eval/reward"), (2, "eval/reward")} <= set(shown)
