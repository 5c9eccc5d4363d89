"""Runner processes joining a live run (agl/agents/attach.py, runner.processes): the same run as with
in-process runners, and stopping one of them (kill -9 or Ctrl-C), or killing the job under them,
costs no rollout anything.

Real harness processes on the reference run (tests/runs.py: the tiny model in float32, batch-invariant),
so an attempt handed back uncharged is rerun with the seeds of the try it replaces, and the run must end
byte-identical to the reference, whose runners all lived in the job's process. runner.max_attempts=1: an
attempt charged to the agent would fail its rollout. The agent sleeps 2 s per rollout here (not in the
reference): when things happen changes, what is computed must not.
"""

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from runs import ROLLOUTS_PER_STEP, RUN, STEPS, adapter, finish, harness, metrics, query

from agl import run as run_in_process
from agl.errors import ConfigError

PROCESSES = ["runner.n=0", "runner.processes=2", "runner.per_process=4"]
SLOW = {"AGL_TEST_AGENT_SLEEP": "2"}  # time to start, and stop, runner processes while the job runs rollouts


def busy_sessions(run_dir: Path) -> dict[int, int]:
    """pid -> attempts in flight, for every open store session (none before the store exists)."""
    if not (run_dir / "store.sqlite").is_file():
        return {}
    return dict(
        query(
            run_dir,
            (
                "SELECT s.pid, count(a.attempt_id) FROM sessions s LEFT JOIN attempts a "
                "ON a.session_id = s.session_id AND a.status IN ('preparing', 'running') "
                "WHERE s.closed_time IS NULL GROUP BY s.pid"
            ),
        )
    )


def wait_for(find, what: str, timeout: float = 300.0):  # generous: a loaded machine starts processes slowly
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := find():
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def stop(*procs) -> None:
    """Kill what still runs, and show each process's output (pytest prints it when the test failed)."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc is not None:
            print(f"--- output of {proc.args[2:4]} (pid {proc.pid}, exit {proc.returncode}):\n{proc.output()[-5000:]}")


def test_runner_processes_run_the_same_job_and_stopping_any_process_costs_nothing(reference, tmp_path, device):
    run_dir, evals = tmp_path / "attached", tmp_path / "evals"  # an empty eval cache: its evals run rollouts too
    job = harness(*RUN, *PROCESSES, f"hydra.run.dir={run_dir}", device=device, eval_cache=evals, env=SLOW)
    by_hand = None

    def busy_runner(*other_than: int) -> int | None:
        return next(
            (pid for pid, n in busy_sessions(run_dir).items() if n >= 2 and pid not in (job.pid, *other_than)), None
        )

    try:
        # kill -9 one of the job's runner processes while it runs rollouts
        victim = wait_for(busy_runner, "a busy runner process")
        # it runs agents and HTTP calls: torch would cost each runner process seconds and hundreds of MiB
        assert not [m.path for m in psutil.Process(victim).memory_maps() if "libtorch" in m.path]
        os.kill(victim, signal.SIGKILL)
        # one started by hand joins; Ctrl-C while it runs rollouts hands them back
        by_hand = harness("algo=runner", f"attach={run_dir}", "runner.n=4", env=SLOW)
        wait_for(lambda: busy_sessions(run_dir).get(by_hand.pid), "the runner started by hand to run rollouts")
        by_hand.send_signal(signal.SIGINT)
        out, _ = by_hand.communicate(timeout=300)
        assert by_hand.returncode == 0 and "Traceback" not in out and "SIGINT" in out, out[-3000:]
        # kill -9 the job itself: its other runner process leaves on its own, handing its rollouts back
        survivor = wait_for(lambda: busy_runner(victim, by_hand.pid), "the other runner process")
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        psutil.Process(survivor).wait(timeout=300)
        job = harness(f"resume={run_dir}", eval_cache=evals, env=SLOW)  # starts runner processes of its own
        finish(job)
    finally:
        stop(job, by_hand)

    assert adapter(run_dir) == adapter(reference)
    assert metrics(run_dir) == metrics(reference)
    # the SFT step: none
    assert [m.get("rollouts") for m in metrics(run_dir)[1:]] == [None] + [ROLLOUTS_PER_STEP] * (STEPS - 1)
    assert query(run_dir, "SELECT count(*) FROM rollouts WHERE status != 'succeeded'") == [(0,)]
    # every attempt that did not succeed was handed back uncharged: by the killed runner process,
    # the interrupted one, and the one whose job was killed
    ended = query(
        run_dir,
        (
            "SELECT s.pid, json_extract(a.metadata, '$.harness_ended') "
            "FROM attempts a JOIN sessions s USING (session_id) "
            "WHERE a.status != 'succeeded' GROUP BY 1, 2"
        ),
    )
    assert set(ended) == {(victim, "dead"), (by_hand.pid, "closed"), (survivor, "closed")}, ended
    # the job withdrew its route; a runner process then refuses to start
    late = harness("algo=runner", f"attach={run_dir}")
    out, _ = late.communicate(timeout=300)
    assert late.returncode == 2 and "is not running" in out, out[-3000:]


def test_no_runners_at_all_is_an_error_not_a_wait(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # agl.run imports the task's agent from the current directory too
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ConfigError, match="runner.n=0 and runner.processes=0"):
        run_in_process(*RUN, "runner.n=0", run_dir=tmp_path / "run")


def test_the_job_fails_when_all_its_runner_processes_exit(tmp_path):
    run_dir = tmp_path / "run"
    job = harness(*RUN, "runner.n=0", "runner.processes=1", f"hydra.run.dir={run_dir}", env=SLOW)
    try:
        child = wait_for(
            lambda: next((pid for pid in busy_sessions(run_dir) if pid != job.pid), None), "the runner process"
        )
        os.kill(child, signal.SIGKILL)
        out, _ = job.communicate(timeout=120)
    finally:
        stop(job)
    assert job.returncode != 0 and "RunnerProcessesExited: all 1 runner processes" in out, out[-3000:]
    assert '"status": "failed"' in (run_dir / "status.json").read_text()
