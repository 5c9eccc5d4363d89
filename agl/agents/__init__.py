"""What runs an agent: the agent API (``LLM``, ``emit_reward``), tasks, asyncio runners, runner processes
and attaching to a running job. Nothing here loads a model: agents reach the policy only through the route."""
