"""GSM8K answered as JSON under a schema the route enforces: ``{"reasoning": str, "answer": int}``."""
