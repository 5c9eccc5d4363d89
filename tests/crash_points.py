"""The e2e agent, plus deliberate SIGKILLs at chosen points of the harness (crash tests), and a pause.

Imported by the harness process itself (as ``task.agent=crash_points:multi_turn_agent``), so
with ``AGL_TEST_KILL`` set it patches that process:

  ``rollout``     dies inside the first rollout this process runs, after its first LLM call;
  ``update``      dies right after the first GRPO update of this process changed the LoRA
                  in memory, before the policy version moves or anything is saved;
  ``update:N``    the same, after the first GRPO update that leaves its optimizer N or more steps
                  taken (a restored optimizer counts the steps it was saved after; a GRPO step
                  whose groups were all dropped takes none): the next process resumes from the
                  checkpoint before it, restoring an optimizer with state;
  ``checkpoint``  dies inside the first checkpoint transaction, after its rows are written
                  and before COMMIT;
  ``round``       dies as the first rollouts of a GRPO step's extra round of draws (dynamic sampling) end: the
                  step's first round finished, the extra one partly;
  ``eval_rows:N`` dies right after this process kept its N-th row in the eval cache
                  (agl/eval/cache.py), the rest of the eval unfinished.

``AGL_TEST_AGENT_SLEEP`` (seconds) slows every rollout down by that much before its first call, so that a
test can stop a runner process while it runs rollouts; it changes when things happen, not what is computed.
"""

import os
import signal
import time

import e2e_agents
from e2e_agents import load  # noqa: F401  (the data the run uses)

KILL_AT = os.environ.get("AGL_TEST_KILL", "")
SLEEP_S = float(os.environ.get("AGL_TEST_AGENT_SLEEP") or 0)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def multi_turn_agent(task: dict, llm, prompt_template: str, never_solved_every: int = 0, **kwargs) -> float:
    """e2e_agents.multi_turn_agent; with ``never_solved_every`` = k, the tasks whose number is a multiple of k score 0
    whatever the replies: tasks the policy never solves, whose groups have equal rewards (dynamic sampling's case)."""
    time.sleep(SLEEP_S)
    if KILL_AT == "rollout":
        e2e_agents.multi_turn_agent(task, llm, prompt_template, max_turns=1)
        _die()
    reward = e2e_agents.multi_turn_agent(task, llm, prompt_template, **kwargs)
    never_solved = never_solved_every and int(task["id"].rsplit("-", 1)[1]) % never_solved_every == 0
    return 0.0 if never_solved else reward


def _die_after(cls: type, name: str, when=lambda self: True) -> None:
    """Patch ``cls.<name>`` to run as usual and then kill the process (if ``when(self)``)."""
    original = getattr(cls, name)

    def patched(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if when(self):
            _die()
        return result

    setattr(cls, name, patched)


def _install(point: str) -> None:
    if point in ("", "rollout"):
        return
    if point == "update" or point.startswith("update:"):
        from agl.train.grpo import GRPOUpdate

        nth = int(point.partition(":")[2] or 0)
        _die_after(GRPOUpdate, "step", when=lambda update: optimizer_steps(update.optimizer) >= nth)
    elif point == "round":
        from agl.runtime import Runtime

        run_rollouts = Runtime.run_rollouts

        async def die_in_an_extra_round(self, inputs, metadata, **kwargs):
            if not any(m.get("round") for m in metadata):
                return await run_rollouts(self, inputs, metadata, **kwargs)

            async def die(ended):
                _die()

            return await run_rollouts(self, inputs, metadata, **kwargs, on_finished=die)

        Runtime.run_rollouts = die_in_an_extra_round
    elif point == "checkpoint":
        from agl.store.runstate import RunState

        _die_after(RunState, "_save_checkpoint_tx")  # inside the transaction: before COMMIT
    elif point.startswith("eval_rows:"):
        from agl.eval.cache import CacheEntry

        rows, write = int(point.partition(":")[2]), CacheEntry.write

        def write_then_die(self, *args, **kwargs):
            write(self, *args, **kwargs)
            if self.written >= rows:
                _die()

        CacheEntry.write = write_then_die
    else:
        raise ValueError(
            f"AGL_TEST_KILL={point!r}: expected rollout, update, update:N, round, checkpoint or eval_rows:N"
        )


def optimizer_steps(optimizer) -> int:
    """How many steps ``optimizer`` (Adam's family) has taken, those before a restore included."""
    return max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)


_install(KILL_AT)
