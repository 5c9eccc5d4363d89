"""The e2e agent, slowed down so that a test can stop a runner process while it runs rollouts."""

import time

from e2e_agents import load, multi_turn_agent  # noqa: F401  (load: the data the run uses)


def slow_agent(task: dict, llm, prompt_template: str, **kwargs) -> float:
    time.sleep(0.4)
    return multi_turn_agent(task, llm, prompt_template, **kwargs)
