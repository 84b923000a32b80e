"""Real OMA servers for the harness tests.

The session and sandbox servers run as child processes (`oma serve ...`, exactly as users
start them), the scripted model server and the harness in the test's event loop, so a test
can start a second harness or look at what the model server was asked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from harness_helpers import HarnessFactory, Peers, SessionClient, spawn_server, stop_server

from oma.runtime.auth import TokenTable


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.json"
    TokenTable.generate().save(path)
    return path


@pytest.fixture
def session_address(tmp_path: Path, tokens_file: Path) -> Iterator[str]:
    proc, address = spawn_server(
        "session",
        [
            "--listen",
            "127.0.0.1:0",
            "--grace-seconds",
            "1",
            "--tokens",
            str(tokens_file),
            "--db",
            f"sqlite:///{tmp_path / 'sessions.db'}",
        ],
        tmp_path,
    )
    yield address
    stop_server(proc)


def _sandbox(tmp_path: Path, tokens_file: Path, backend: str) -> Iterator[str]:
    proc, address = spawn_server(
        "sandbox",
        [
            "--listen",
            "127.0.0.1:0",
            "--grace-seconds",
            "1",
            "--tokens",
            str(tokens_file),
            "--backend",
            backend,
        ],
        tmp_path,
    )
    yield address
    stop_server(proc)


@pytest.fixture
def local_sandbox_address(tmp_path: Path, tokens_file: Path, bwrap_path: str) -> Iterator[str]:
    yield from _sandbox(tmp_path, tokens_file, "local")


@pytest.fixture
def docker_sandbox_address(
    tmp_path: Path, tokens_file: Path, docker_client: object
) -> Iterator[str]:
    yield from _sandbox(tmp_path, tokens_file, "docker")


@pytest.fixture
def local_peers(tokens_file: Path, session_address: str, local_sandbox_address: str) -> Peers:
    return Peers(
        TokenTable.load(tokens_file), tokens_file, session_address, local_sandbox_address, "local"
    )


@pytest.fixture
def docker_peers(tokens_file: Path, session_address: str, docker_sandbox_address: str) -> Peers:
    return Peers(
        TokenTable.load(tokens_file), tokens_file, session_address, docker_sandbox_address, "docker"
    )


@pytest.fixture
async def harness_factory() -> AsyncIterator[HarnessFactory]:
    factory = HarnessFactory()
    yield factory
    for harness in factory.started:
        await harness.stop(1)


@pytest.fixture
async def local_client(local_peers: Peers) -> AsyncIterator[SessionClient]:
    client = SessionClient(local_peers)
    yield client
    await client.close()


@pytest.fixture
async def docker_client_oma(docker_peers: Peers) -> AsyncIterator[SessionClient]:
    client = SessionClient(docker_peers)
    yield client
    await client.close()
