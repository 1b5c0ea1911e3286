"""The caller of a request, as the store sees it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Principal:
    """The caller, from its API key."""

    user_id: int
    name: str
    admin: bool = False

    @property
    def owner(self) -> Any:
        """What the store takes on every call; the store enforces it."""
        from cartridges.store import core

        return core().Owner(self.user_id, self.admin)
