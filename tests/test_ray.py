"""The Ray lane (``make test-ray``, .venv-ray): runner processes launched on a Ray cluster (``runner.launcher=ray``,
agl/agents/launch.py), against a local Ray head this test starts.

Three processes, each started with a URL, train the reference run together (tests/runs.py): a store
(``algo=store``), the training job (``store.url``, its runners two Ray actors, joined by the store's URL), and a
fourth runner process started by hand mid-run (``algo=runner store.url=...``). The job must end byte-identical to
the reference, whose runners all lived in the job's process.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from runs import RUN, adapter, finish, harness, metrics, query
from test_attach import SLOW, busy_sessions, stop, wait_for

ray = pytest.importorskip("ray", reason="the Ray lane: make test-ray")


@pytest.fixture
def ray_head(tmp_path_factory):
    """A local Ray cluster of its own (``ray start --head --block``: stopping that process stops the cluster)."""
    temp = tmp_path_factory.mktemp("ray")
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [str(ray_cli), "start", "--head", "--block", "--port=0", "--num-cpus=4", "--include-dashboard=false"]
        + ["--disable-usage-stats", f"--temp-dir={temp}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []

    def address() -> str | None:
        line = head.stdout.readline()
        lines.append(line)
        found = re.search(r"--address='([^']+)'", line) or re.search(r"address='?(\d+\.\d+\.\d+\.\d+:\d+)", line)
        if head.poll() is not None:
            raise AssertionError("ray start failed:\n" + "".join(lines))
        return found.group(1) if found else None

    try:
        yield wait_for(address, "the Ray head", timeout=180)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def test_a_store_a_job_and_runners_on_ray_each_started_with_a_url_train_the_reference(reference, tmp_path, ray_head):
    job_dir, store_dir, evals = tmp_path / "job", tmp_path / "store", tmp_path / "evals"
    store = harness("algo=store", "store.port=0", f"hydra.run.dir={store_dir}")
    job = fourth = None
    try:
        url = wait_for(lambda: re.search(r"store\.url=(http://\S+)\)", store.output()), "the store").group(1)
        job = harness(
            *RUN,
            "runner.n=0",
            "runner.processes=2",
            "runner.per_process=4",
            "runner.launcher=ray",
            f"store.url={url}",
            f"hydra.run.dir={job_dir}",
            eval_cache=evals,
            env={**SLOW, "RAY_ADDRESS": ray_head},
        )
        ray_runners = wait_for(
            lambda: (busy := [p for p, n in busy_sessions(store_dir).items() if n and p != job.pid]) and busy,
            "the Ray actors to run rollouts",
        )
        # Ray's workers, started by its raylet: not the job's children
        assert {psutil.Process(pid).parent().name() for pid in ray_runners} == {"raylet"}, ray_runners
        fourth = harness("algo=runner", f"store.url={url}", "runner.n=4", f"hydra.run.dir={tmp_path / 'fourth'}")
        wait_for(lambda: busy_sessions(store_dir).get(fourth.pid), "the fourth runner to run rollouts")
        out = finish(job)
        assert "Traceback" not in out, out[-3000:]
        assert "the job stopped" in finish(fourth)
        store.send_signal(signal.SIGINT)
        finish(store)
    finally:
        stop(job, fourth, store)

    assert adapter(job_dir) == adapter(reference)
    assert metrics(job_dir) == metrics(reference)
    assert query(store_dir, "SELECT count(*) FROM rollouts WHERE status != 'succeeded'") == [(0,)]
    workers = {
        p for (p,) in query(store_dir, "SELECT DISTINCT s.pid FROM attempts a JOIN sessions s USING (session_id)")
    }
    assert fourth.pid in workers and set(ray_runners) <= workers, workers
