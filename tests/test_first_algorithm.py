"""examples/first_algorithm.py, agent-lightning's "write your first algorithm" in agl's names, run as its docstring
says: a store (``algo=store``), the policy's route (``algo=serve store.url=...``) and runners
(``algo=runner store.url=...``), each a process started with the store's URL, and the script against them.

On the tiny random model, with an agent whose reward the prompt template decides (workflow_agents.marker_agent,
as tests/test_custom_algo.py's ``algo=custom`` version): it must pick the marked template.
"""

from __future__ import annotations

import json
import re
import runpy
import signal
import sys

from runs import ROOT, finish, harness
from test_attach import stop, wait_for
from test_custom_algo import assert_marked_wins

SERVE = [
    "model=tiny",
    "progress=false",
    "task=hello",
    "task.agent=workflow_agents:marker_agent",
    "+task.prompts.marked='[BEST] {question}'",
    "algo=serve",
    "server.port=0",
]


def test_the_first_algorithm_runs_as_its_own_script_against_the_store_by_url(tmp_path, monkeypatch, capsys):
    store = harness("algo=store", "store.port=0", f"hydra.run.dir={tmp_path / 'store'}")
    serve = runner = None
    try:
        url = wait_for(lambda: re.search(r"store\.url=(http://\S+)\)", store.output()), "the store").group(1)
        serve = harness(*SERVE, f"store.url={url}", f"hydra.run.dir={tmp_path / 'serve'}")
        runner = harness("algo=runner", f"store.url={url}", "runner.n=8", f"hydra.run.dir={tmp_path / 'runner'}")
        monkeypatch.setattr(sys, "argv", ["first_algorithm.py", "--store", url])
        capsys.readouterr()
        runpy.run_path(str(ROOT / "examples" / "first_algorithm.py"), run_name="__main__")
        printed = capsys.readouterr().out
        result = json.loads(printed[printed.index("{") :])
        serve.send_signal(signal.SIGTERM)
        finish(serve)
        assert "the job stopped" in finish(runner)  # the serving job withdrew its route: the runners leave
        store.send_signal(signal.SIGINT)
        finish(store)
    finally:
        stop(serve, runner, store)
    assert_marked_wins({**result, "metrics": {"best_reward": result["scores"]["marked"]}})
