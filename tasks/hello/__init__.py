"""`hello`: teach the model to introduce itself with a target identity (the fastest proof that training works)."""
