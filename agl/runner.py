"""Deprecated: moved to ``agl.agents.runner``. This name keeps old imports working (``from agl.runner import Hook``)."""

from agl.agents.runner import Hook, Runner, RunnerPool

__all__ = ["Hook", "Runner", "RunnerPool"]
