"""Runs registered checks against a target and rolls results up per requirement."""

from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass
from enum import StrEnum

from oma.conformance.registry import REGISTRY, Check
from oma.conformance.requirements import Level
from oma.conformance.target import Target


class Outcome(StrEnum):
    PASS = "pass"
    FAIL = "fail"  # an assertion about the contract did not hold
    ERROR = "error"  # the check could not run to its assertion (e.g. unexpected status)
    SKIP = "skip"  # the target does not advertise a feature the check needs


@dataclass
class Result:
    check: Check
    outcome: Outcome
    detail: str
    seconds: float

    @property
    def blocks_run(self) -> bool:
        """MUST failures and errors fail the run; SHOULD failures are only reported."""
        return self.outcome in (Outcome.FAIL, Outcome.ERROR) and self.check.level == Level.MUST


async def run_check(check: Check, target: Target, seconds_allowed: float) -> Result:
    started = time.monotonic()
    try:
        if check.requires_features:
            advertised = await target.features(check.service)
            missing = [f for f in check.requires_features if f not in advertised]
            if missing:
                return Result(check, Outcome.SKIP, f"not advertised: {', '.join(missing)}", 0.0)
        async with asyncio.timeout(seconds_allowed):
            await check.function(target)
        return Result(check, Outcome.PASS, "", time.monotonic() - started)
    except AssertionError as failure:
        detail = str(failure) or traceback.format_exc(limit=-2)
        return Result(check, Outcome.FAIL, detail, time.monotonic() - started)
    except Exception as error:  # reported, never swallowed: the run fails on MUST errors
        detail = f"{type(error).__name__}: {error}"
        return Result(check, Outcome.ERROR, detail, time.monotonic() - started)


async def run_suite(target: Target, services: list[str], *, name_filter: str = "",
                    seconds_per_check: float = 60.0) -> list[Result]:
    from oma.conformance import checks  # noqa: F401  (registers every check)

    selected = [c for c in REGISTRY.values()
                if c.service in services and name_filter in c.name]
    return [await run_check(c, target, seconds_per_check) for c in sorted(selected, key=lambda c: c.name)]
