"""tasks/q20/crewai_agent.py imports CrewAI, an optional extra in a venv of its own (`make test-crewai`):
its doctests are collected only where CrewAI is installed."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("crewai") else ["q20/crewai_agent.py"]
