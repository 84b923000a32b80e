"""Checks and the requirements they cite. A check is an async function taking a `Target`;
it fails by raising `AssertionError` (or any exception, reported as an error)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oma.conformance.requirements import Level, Requirement, requirements

if TYPE_CHECKING:
    from oma.conformance.target import Target

CheckFunction = Callable[["Target"], Awaitable[None]]


@dataclass(frozen=True)
class Check:
    """A runnable check: its name, the service it exercises, the requirements it proves."""

    name: str
    service: str  # "session", "sandbox", "vault", "harness"
    requirement_ids: tuple[str, ...]
    function: CheckFunction
    requires_features: tuple[str, ...] = field(default=())

    @property
    def requirements(self) -> list[Requirement]:
        table = requirements()
        return [table[i] for i in self.requirement_ids]

    @property
    def level(self) -> Level:
        """The strongest level among the cited requirements."""
        return max((r.level for r in self.requirements), key=lambda lvl: lvl.rank)


REGISTRY: dict[str, Check] = {}


def check(service: str, *requirement_ids: str, requires_features: tuple[str, ...] = ()
          ) -> Callable[[CheckFunction], CheckFunction]:
    """Register a check. Citing an unknown requirement id, or registering a name twice, fails
    at import time so that a broken suite can never report green."""
    table = requirements()
    unknown = [i for i in requirement_ids if i not in table]
    if not requirement_ids or unknown:
        raise ValueError(f"check cites unknown requirement ids {unknown or '(none)'}")

    def register(function: CheckFunction) -> CheckFunction:
        name = f"{service}.{function.__name__.removeprefix('check_')}"
        if name in REGISTRY:
            raise ValueError(f"duplicate conformance check {name}")
        REGISTRY[name] = Check(name, service, tuple(requirement_ids), function, requires_features)
        return function

    return register
