"""Registries of the update's parts by name: policy losses (``agl.train.loss``) and advantage
estimators (``agl.train.advantages``).

A config names a part by its registered name (``algo.loss.type=sapo``) or as ``module:function``
(``algo.loss.type=my_losses:clipped_tanh``): a decorated function in the user's own file, imported
as ``task.agent`` is (from the current directory or ``PYTHONPATH``), with no edit to agl.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from agl.agents.tasks import import_object
from agl.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind (``kind``: "loss"), set in config as ``key``, made by the ``decorator``."""

    def __init__(self, kind: str, key: str, entry_type: type, decorator: str):
        self.kind, self.key, self.entry_type, self.decorator = kind, key, entry_type, decorator
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> None:
        if ":" in name:
            raise ValueError(f"a registered {self.kind}'s name has no ':' ({name!r}): that form is module:function")
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"a {self.kind} named '{name}' is registered already")
        self._entries[name] = entry

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> T:
        """The entry registered as ``name``, or the decorated function ``module:function`` names."""
        if ":" not in name:
            if name not in self._entries:
                raise ConfigError(
                    f"{self.key}={name!r} is not a registered {self.kind} ({' | '.join(self._entries)}), "
                    f"nor module:function"
                )
            return self._entries[name]
        entry = import_object(name)
        if not isinstance(entry, self.entry_type):
            raise ConfigError(
                f"{self.key}={name!r} is a {type(entry).__name__}, not a {self.kind}: "
                f"decorate it with @{self.decorator}(...) (docs/algorithms.md)"
            )
        return entry
