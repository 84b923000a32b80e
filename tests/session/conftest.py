"""Session-service fixtures: every test runs against a SQLite file and a real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.runtime.server import ServerOptions
from oma.servers.session.server import SessionServer
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh database URL: a SQLite file, or a fresh PostgreSQL database (asyncpg)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sessions.db'}"
    url: str = request.getfixturevalue("pg_database")
    return url.replace("postgresql://", "postgresql+asyncpg://", 1)


@pytest.fixture
def tokens() -> TokenTable:
    return TokenTable.generate()


@pytest.fixture
async def server(db_url: str, tokens: TokenTable) -> AsyncIterator[SessionServer]:
    running = await SessionServer.start(db_url, ServerOptions(tokens=tokens, grace_seconds=0.5))
    try:
        yield running
    finally:
        await running.stop(0.5)


@pytest.fixture
async def stub_for(
    tokens: TokenTable,
) -> AsyncIterator[Callable[[SessionServer | str, str], SessionServiceStub]]:
    """`stub_for(server_or_address, role)`: a stub whose calls carry that role's token."""
    channels = []

    def make(target: SessionServer | str, role: str) -> SessionServiceStub:
        address = target if isinstance(target, str) else target.address
        channel = connect(address, token=tokens.token_for(role))
        channels.append(channel)
        return SessionServiceStub(channel)

    yield make
    for channel in channels:
        await channel.close()


@pytest.fixture
def client(
    server: SessionServer, stub_for: Callable[..., SessionServiceStub]
) -> SessionServiceStub:
    return stub_for(server, "client")


@pytest.fixture
def harness(
    server: SessionServer, stub_for: Callable[..., SessionServiceStub]
) -> SessionServiceStub:
    return stub_for(server, "harness")
