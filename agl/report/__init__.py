"""What a run dir holds and how it is read: metrics.jsonl, status.json, curves, report.md, sweep summaries and
the optional loggers. No torch at import time (``make lint``'s import contract)."""
