"""The conformance suite's sandbox checks pass against the reference sandbox server, on both
of its backends (Docker and bubblewrap)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oma.conformance.runner import Outcome, run_suite
from oma.conformance.target import Target
from oma.runtime.auth import TokenTable
from oma.runtime.server import ServerOptions
from oma.servers.sandbox.server import build_manager, start_sandbox_server


@pytest.mark.parametrize("backend", ["docker", "local"])
async def test_reference_sandbox_server_passes_every_check(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("docker_client" if backend == "docker" else "bwrap_path")
    tokens = TokenTable.generate()
    manager = build_manager(backend, tmp_path / "sandboxes")
    running = await start_sandbox_server(manager, ServerOptions(tokens=tokens, grace_seconds=0.2))
    roles = ("client", "harness", "sandbox_server", "admin")
    target = Target({"sandbox": running.address}, {r: tokens.token_for(r) for r in roles})
    try:
        results = await run_suite(target, ["sandbox"])
    finally:
        await target.close()
        await running.stop(0.2)
        await manager.close()
    assert len(results) >= 10
    failures = [f"{r.check.name}: {r.detail}" for r in results if r.outcome != Outcome.PASS]
    assert not failures, failures
