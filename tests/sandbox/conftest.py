"""Fixtures of the sandbox tests: a sandbox server on each backend (parametrized), and a
fresh sandbox in it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sandbox_helpers import BACKENDS, SandboxServer, backend_fixtures, start, stop


@pytest.fixture(params=BACKENDS)
async def sandbox_server(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[SandboxServer]:
    backend = request.param
    backend_fixtures(request, backend)
    server = await start(backend, tmp_path / "sandboxes")
    try:
        yield server
    finally:
        await stop(server)


@pytest.fixture
async def sandbox_id(sandbox_server: SandboxServer) -> str:
    sandbox = await sandbox_server.provision(labels={"oma.dev/session-id": "sess-test"})
    return sandbox.id
