"""Deprecated: moved to ``agl.eval.evaluate``. This name keeps old imports working (``agl.evaluate.evaluate``)."""

from agl.eval.evaluate import eval_during_training, eval_metrics, evaluate, evaluate_rows, rollout_scores, summarize

__all__ = ["eval_during_training", "eval_metrics", "evaluate", "evaluate_rows", "rollout_scores", "summarize"]
