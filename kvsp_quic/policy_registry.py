"""Policies that configurations choose by name (the holder's eviction policy, the controller's placement policy):
one registry of factories per kind of policy."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Generic, TypeVar

P = TypeVar("P")

_NAME = re.compile(r"[a-z][a-z0-9_-]*")


class PolicyRegistry(Generic[P]):
    """The factories of one *kind* of policy (``"eviction"``, ``"placement"``) by lowercase name. *factories* is
    the registry's own dict (modules expose it: ``EVICTION_POLICIES``)."""

    def __init__(self, kind: str, factories: dict[str, Callable[[], P]]) -> None:
        self.kind = kind
        self.factories = factories

    def register(self, name: str, factory: Callable[[], P]) -> None:
        """Make a policy available by *name* (lowercase letters, digits, '-' or '_') to configurations."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"{self.kind} policy name {name!r} must be lowercase letters, digits, '-' or '_'")
        self.factories[name] = factory

    def create(self, name: str) -> P:
        """A new instance of the policy registered as *name*; ``ValueError`` naming the known ones otherwise."""
        try:
            factory = self.factories[name]
        except KeyError:
            known = ", ".join(sorted(self.factories))
            raise ValueError(f"unknown {self.kind} policy {name!r} (known: {known})") from None
        return factory()
