"""Fixtures of the vault tests: a real vault gRPC server (SQLite in a temp dir by default)
and helpers to call it with each role."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from vault_server import VaultUnderTest, start_vault, stop_vault


@pytest.fixture
async def vault(tmp_path: Path) -> AsyncIterator[VaultUnderTest]:
    v = await start_vault(tmp_path)
    try:
        yield v
    finally:
        await stop_vault(v)


@pytest.fixture
async def echo_server() -> AsyncIterator[Any]:
    from vault_upstreams import LoopbackServer, echo_app

    server = await LoopbackServer(echo_app()).start()
    try:
        yield server
    finally:
        await server.stop()
