"""Scoring a policy through the runners and the route: evaluations, their statistics (Wilson, McNemar) and
the failed rollouts that explain a bad score."""
