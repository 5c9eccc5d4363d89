"""Errors that carry a message meant for the user, printed by the harness without a traceback."""


class ConfigError(Exception):
    """A setting or input the user can fix: the message says what is wrong and how to fix it."""
