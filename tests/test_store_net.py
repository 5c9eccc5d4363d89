"""Beyond one machine: a store, a training job and runners, each started with a URL, train the reference run
together, and runners on other hosts that are killed, cut off and started again cost no rollout.

Real processes, as a user starts them in three terminals (docs/running.md, "Beyond one machine"):

  * the store: ``algo=store`` on every address (so beyond the loopback: it needs its key), with a short
    session deadline (``store.session_timeout=3``);
  * the training job: tests/runs.py's reference run, with ``store.url`` and no runners of its own in its
    process; its one runner process is a submitit job (``runner.launcher=submitit_local``: the SLURM launcher
    on submitit's local executor), joined by the store's URL;
  * runners on two other hosts (tests/hosts.py: a network namespace each, reaching only the store's and the
    route's addresses, and a mount namespace in which the run's files do not exist), joined with a store URL,
    a route URL and the key. One is killed (kill -9), one is cut off (its link down) past its session's
    deadline and comes back, and a fourth runner process joins mid-run.

The job is the reference's (the tiny model in float32, batch-invariant, ``runner.max_attempts=1``: an attempt
charged to the agent would fail its rollout), so it must end byte-identical to the reference, whose runners
all lived in the job's process: the same adapter bytes and metrics, every rollout succeeded, and every attempt
that did not succeed ended with its runner's session (dead: killed or cut off), uncharged.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
from hosts import Host
from runs import ROLLOUTS_PER_STEP, ROOT, RUN, STEPS, adapter, finish, harness, metrics, query
from test_attach import busy_sessions, stop, wait_for

STORE_KEY, ROUTE_KEY = "store-sekret", "route-sekret"
DEADLINE_S = 3  # store.session_timeout: a runner whose heartbeats stop this long is ended
SLOW = {"AGL_TEST_AGENT_SLEEP": "1"}  # time to kill and cut runner processes while they run rollouts


def open_files(pid: int) -> list[str]:
    """What the process has open (its /proc/<pid>/fd links; sockets and pipes name no path)."""
    return [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]


def sessions_of(store_dir: Path, pid: int) -> list[str]:
    return [row[0] for row in query(store_dir, f"SELECT session_id FROM sessions WHERE pid = {pid} ORDER BY rowid")]


def test_runners_by_url_on_other_hosts_killed_cut_off_and_restarted_leave_the_run_byte_identical(
    reference, tmp_path, device
):
    run = tmp_path / "run"  # what the other hosts must not see: the job's run dir and the store's
    job_dir, store_dir, evals = run / "job", run / "store", tmp_path / "evals"
    env = {**os.environ, **SLOW, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
    store = harness(
        "algo=store",
        "store.host=0.0.0.0",
        "store.port=0",
        f"store.api_key={STORE_KEY}",
        f"store.session_timeout={DEADLINE_S}",
        f"hydra.run.dir={store_dir}",
    )
    job = hosts = None
    runners: list = []
    try:
        port = wait_for(lambda: re.search(r"store\.url=http://0\.0\.0\.0:(\d+)", store.output()), "the store").group(1)
        job = harness(
            *RUN,
            "runner.n=0",
            "runner.processes=1",
            "runner.per_process=4",
            "runner.launcher=submitit_local",
            f"store.url=http://127.0.0.1:{port}",
            f"store.api_key={STORE_KEY}",
            "server.host=0.0.0.0",
            f"server.api_key={ROUTE_KEY}",
            f"hydra.run.dir={job_dir}",
            device=device,
            eval_cache=evals,
            env=SLOW,
        )
        entry = wait_for(lambda: query(store_dir, "SELECT value FROM run_info WHERE key = 'runners'"), "the route")
        route_port = urlsplit(json.loads(entry[0][0])["rollout_url"]).port
        hosts = [Host(), Host()]

        def runner(host: Host, n: int = 4):
            proc = host.harness(
                "algo=runner",
                f"store.url=http://{host.gateway}:{port}",
                f"store.api_key={STORE_KEY}",
                f"algo.route_url=http://{host.gateway}:{route_port}",
                f"runner.n={n}",
                f"hydra.run.dir={tmp_path / 'runners' / str(len(runners))}",
                hide=[run],
                env=env,
            )
            runners.append(proc)
            return proc

        def busy(proc) -> bool:
            return busy_sessions(store_dir).get(proc.pid, 0) >= 2

        killed, cut_off = runner(hosts[0]), runner(hosts[1])
        wait_for(lambda: busy(killed) and busy(cut_off), "both hosts' runners to run rollouts")
        for proc in (killed, cut_off):  # nothing of the run is open there, nor could be
            assert not [f for f in open_files(proc.pid) if f.startswith(f"{run}/")], open_files(proc.pid)
            assert not psutil.Process(proc.pid).cwd().startswith(f"{run}/")
        # kill -9 one: its heartbeats stop, the store ends its session and hands its attempts back
        os.kill(killed.pid, signal.SIGKILL)
        # cut the other off past its deadline: the store ends its session; back online, it joins again
        hosts[1].cut()
        time.sleep(DEADLINE_S + 1.5)
        hosts[1].restore()
        wait_for(lambda: len(sessions_of(store_dir, cut_off.pid)) >= 2, "the cut-off runner to join again")
        # the killed host's runner process started again: a fourth runner process joins mid-run
        restarted = runner(hosts[0])
        finish(job)
        for proc in (cut_off, restarted):  # they leave when the job ends
            out = finish(proc, timeout=120)
            assert "Traceback" not in out and "the job stopped" in out, out[-3000:]
        store.send_signal(signal.SIGINT)
        assert "stopped serving" in finish(store, timeout=120)
    finally:
        stop(job, store, *runners)
        for host in hosts or ():
            host.close()

    assert adapter(job_dir) == adapter(reference)
    assert metrics(job_dir) == metrics(reference)
    assert [m.get("rollouts") for m in metrics(job_dir)[1:]] == [None] + [ROLLOUTS_PER_STEP] * (STEPS - 1)  # SFT: none
    assert query(store_dir, "SELECT count(*) FROM rollouts WHERE status != 'succeeded'") == [(0,)]
    # every attempt that did not succeed was handed back uncharged when its runner's session ended: the
    # killed one's and the cut-off one's, for want of heartbeats
    ended = query(
        store_dir,
        "SELECT s.pid, json_extract(a.metadata, '$.harness_ended') FROM attempts a JOIN sessions s USING (session_id) "
        "WHERE a.status != 'succeeded' GROUP BY 1, 2",
    )
    assert set(ended) == {(killed.pid, "dead"), (cut_off.pid, "dead")}, ended
    # the submitit runner process, the hosts' three and the job ran rollouts: each a session of the store's
    pids = {
        row[0] for row in query(store_dir, "SELECT DISTINCT s.pid FROM attempts a JOIN sessions s USING (session_id)")
    }
    assert {killed.pid, cut_off.pid, restarted.pid} <= pids, pids
