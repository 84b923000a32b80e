"""The whole suite, every service, against a reference deployment started the way `oma up`
starts it (four server processes, one tokens file)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from oma.cli._stack import start_stack
from oma.conformance.runner import Outcome, Result, run_suite
from oma.conformance.target import SERVICES, Target


def test_every_check_passes_against_an_oma_up_deployment(tmp_path: Path, bwrap_path: str) -> None:
    stack = start_stack(tmp_path / "oma", backend="local", fixed_ports=False, record=False,
                        grace_seconds=1)
    try:
        addresses = {name: getattr(stack.info, name) for name in SERVICES}
        target = Target(addresses, json.loads(Path(stack.info.tokens_file).read_text()))

        async def run_all() -> list[Result]:
            try:
                return await run_suite(target, list(SERVICES))
            finally:
                await target.close()

        results = asyncio.run(run_all())
    finally:
        stack.stop(grace_seconds=5)
    ran = {r.check.service for r in results if r.outcome == Outcome.PASS}
    assert ran == set(SERVICES), f"no passing check for {set(SERVICES) - ran}"
    failures = [f"{r.check.name}: {r.detail}" for r in results if r.outcome != Outcome.PASS]
    assert not failures, failures


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_has_checks(service: str) -> None:
    from oma.conformance import checks  # noqa: F401
    from oma.conformance.registry import REGISTRY

    assert sum(c.service == service for c in REGISTRY.values()) >= 3
