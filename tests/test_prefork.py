"""tests/prefork.py: a forked harness is the harness a test would have started with ``python harness.py``,
less its imports. (That a forked run computes what a fresh one does, byte for byte, is
tests/test_reproducible.py's ``test_one_seed_gives_one_run``: a fresh run against the forked reference.)"""

from __future__ import annotations

import os
import signal
import subprocess

import prefork
from runs import ForkedHarness, Harness, finish, harness


def test_the_forkserver_has_imported_what_a_job_imports(tmp_path):
    missing = tmp_path / "missing"
    child = prefork.context().Process(target=prefork.missing_preloads, args=(str(missing),))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and missing.read_text() == ""


def lines_about_this_process(out: str) -> list[str]:
    keep = ("torch threads:", "error:")  # "torch threads: 1 (...); malloc: mimalloc"
    return [line.split("] - ", 1)[-1] for line in out.splitlines() if any(k in line for k in keep)]


def test_a_forked_harness_reads_the_tests_environment_and_runs_under_the_same_malloc(tmp_path):
    """The thread count comes from the environment the test gives (OMP_NUM_THREADS, read by agl when imported:
    not the forkserver's), and the allocator is the one a fresh harness re-executes itself under."""
    env = {"OMP_NUM_THREADS": "1"}
    args = ("model=tiny", "algo=info")
    forked = harness(*args, f"hydra.run.dir={tmp_path / 'forked'}", env=env)
    fresh = harness(*args, f"hydra.run.dir={tmp_path / 'fresh'}", env=env, fresh=True)
    assert isinstance(forked, ForkedHarness) and isinstance(fresh, Harness)
    forked_out, fresh_out = finish(forked), finish(fresh)
    assert "torch threads: 1 " in forked_out, forked_out[-3000:]
    assert lines_about_this_process(forked_out) == lines_about_this_process(fresh_out)  # malloc: ... included


def test_a_forked_harness_is_its_own_process_group_and_dies_by_kill_9(tmp_path):
    proc = harness("model=tiny", "algo=info", f"hydra.run.dir={tmp_path}")
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL


def test_a_shell_command_runs_the_harness_forked_with_its_exit_code_and_output(tmp_path):
    """``python <checkout>/harness.py`` typed in a shell (tests/test_doc_examples.py) goes to the test process's
    forkserver and comes back as the shell would see the harness: its exit code, its stderr."""
    forks = prefork.ForkService(tmp_path / "forks")
    try:
        env = forks.env({**os.environ, "OMP_NUM_THREADS": "1"})
        typo = f"python {prefork.HARNESS} modle.path=x; echo exit=$? >&2"
        result = subprocess.run(
            ["bash", "-c", typo], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        lines = result.stderr.strip().splitlines()
        assert lines[-1] == "exit=2" and len(lines) == 2 and lines[0].startswith("error: "), result.stderr
        assert "modle" in lines[0] and result.stdout == ""
        who = subprocess.run(["bash", "-c", "command -v python"], env=env, capture_output=True, text=True)
        assert who.stdout.strip() == str(forks.bin / "python")  # the shell's python is the service's
    finally:
        forks.close()
