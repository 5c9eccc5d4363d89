"""Deprecated: moved to ``agl.report.sweep``. This name stays because runs made before the move name
``agl.sweep.SweepSummary`` as a Hydra callback in their ``.hydra/`` configs: ``resume=`` of such a run loads it."""

from agl.report.sweep import EXCLUDED_KEYS, SweepSummary, job_dir_name, sweep_id, write_sweep_summary

__all__ = ["EXCLUDED_KEYS", "SweepSummary", "job_dir_name", "sweep_id", "write_sweep_summary"]
