"""Durability: acknowledged appends survive SIGKILL of the server; durable settings are in
force at runtime, and the server refuses to start on settings that could lose them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import psycopg
import pytest
from session_helpers import user_message
from sqlalchemy import create_engine

from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.servers.session.database import (
    DatabaseInUse,
    DurabilityError,
    check_settings,
    open_database,
)
from oma.servers.session.server import SessionServer
from oma.session.v1 import definition_pb2
from oma.session.v1 import session_service_pb2 as pb
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub

PATIENCE = 60.0  # hang protection only


class ServerProcess:
    """`oma serve session` as a child process."""

    def __init__(self, db_url: str, tokens_file: Path) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oma.cli.main",
                "serve",
                "session",
                "--listen",
                "127.0.0.1:0",
                "--db",
                db_url,
                "--tokens",
                str(tokens_file),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.address = ""

    async def wait_ready(self) -> str:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), PATIENCE)
        if "serving on" not in line:
            self.proc.kill()
            raise AssertionError(f"server did not start: {line!r} {self.proc.stderr.read()}")  # type: ignore[union-attr]
        self.address = line.rsplit(" ", 1)[1].strip()
        return self.address

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=PATIENCE)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=PATIENCE)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
async def tokens_file(tmp_path: Path, tokens: TokenTable) -> AsyncIterator[Path]:
    path = tmp_path / "tokens.json"
    tokens.save(path)
    yield path


async def test_acknowledged_appends_survive_sigkill(
    db_url: str, tokens: TokenTable, tokens_file: Path
) -> None:
    server = ServerProcess(db_url, tokens_file)
    try:
        address = await server.wait_ready()
        channel = connect(address, token=tokens.token_for("client"))
        stub = SessionServiceStub(channel)
        sid = (
            await stub.CreateSession(
                pb.CreateSessionRequest(definition=definition_pb2.SessionDefinition(model="m"))
            )
        ).session.id
        acknowledged: dict[str, list[int]] = {}  # batch name → seqs the server acknowledged
        enough = asyncio.Event()

        async def writer(w: int) -> None:
            for i in range(10_000):
                name = f"b{w}x{i}"
                batch = [user_message(f"{name}/{j}", f"{name}-{j}") for j in range(1 + i % 7)]
                try:
                    response = await stub.AppendEvents(
                        pb.AppendEventsRequest(session_id=sid, events=batch)
                    )
                except grpc.aio.AioRpcError:
                    return  # the server died under us
                acknowledged[name] = list(response.seqs)
                if len(acknowledged) >= 60:
                    enough.set()

        writers = [asyncio.create_task(writer(w)) for w in range(6)]
        await asyncio.wait_for(enough.wait(), PATIENCE)
        server.kill()  # mid-stream: other appends are in flight
        await asyncio.wait_for(asyncio.gather(*writers), PATIENCE)
        await channel.close()
        assert len(acknowledged) >= 60
    finally:
        server.stop()

    restarted = ServerProcess(db_url, tokens_file)
    try:
        channel = connect(await restarted.wait_ready(), token=tokens.token_for("client"))
        stub = SessionServiceStub(channel)
        stored = []
        token = ""
        while True:
            page = await stub.GetEvents(
                pb.GetEventsRequest(session_id=sid, page_size=1000, page_token=token)
            )
            stored += list(page.events)
            token = page.next_page_token
            if not token:
                break
        await channel.close()
    finally:
        restarted.stop()
    # Gapless from 1, and every acknowledged event is there with its acknowledged seq.
    assert [e.seq for e in stored] == list(range(1, len(stored) + 1))
    seq_of = {e.id: e.seq for e in stored}
    for name, seqs in acknowledged.items():
        assert [seq_of.get(f"{name}-{j}") for j in range(len(seqs))] == seqs
    # No partial batch: each batch is wholly present (consecutive seqs) or wholly absent.
    batches: dict[str, list[int]] = {}
    for event in stored[1:]:
        batches.setdefault(event.id.rsplit("-", 1)[0], []).append(event.seq)
    for name, seqs in batches.items():
        size = 1 + int(name.split("x")[1]) % 7
        assert len(seqs) == size and seqs == list(range(seqs[0], seqs[0] + size)), name


async def test_durability_settings_in_force_at_runtime(db_url: str, tokens: TokenTable) -> None:
    if db_url.startswith("postgresql"):
        # Even a database whose default is `off` gets `on` on the server's connections.
        name = db_url.rsplit("/", 1)[1]
        admin = db_url.replace("postgresql+asyncpg://", "postgresql://", 1)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'ALTER DATABASE "{name}" SET synchronous_commit = off')
    from oma.runtime.server import ServerOptions

    server = await SessionServer.start(db_url, ServerOptions(tokens=tokens))
    try:
        # Read back from the server's own writing connections, after real traffic.
        channel = connect(server.address, token=tokens.token_for("client"))
        await SessionServiceStub(channel).CreateSession(
            pb.CreateSessionRequest(definition=definition_pb2.SessionDefinition(model="m"))
        )
        await channel.close()
        settings = await server.store.db.durability_settings()
    finally:
        await server.stop(0.5)
    if db_url.startswith("sqlite"):
        assert settings == {"journal_mode": "wal", "synchronous": "2"}
    else:
        assert settings == {"synchronous_commit": "on", "fsync": "on"}


async def test_refuses_non_durable_sqlite(tmp_path: Path) -> None:
    with pytest.raises(DurabilityError, match="in-memory"):
        await open_database("sqlite:///:memory:")
    # A plain engine on a fresh file runs SQLite's defaults (rollback journal): refused.
    plain = create_engine(f"sqlite:///{tmp_path / 'plain.db'}")
    with plain.connect() as conn:
        settings = {
            "journal_mode": str(conn.exec_driver_sql("PRAGMA journal_mode").scalar_one()),
            "synchronous": str(conn.exec_driver_sql("PRAGMA synchronous").scalar_one()),
        }
    plain.dispose()
    with pytest.raises(DurabilityError, match="WAL"):
        check_settings("sqlite", settings)
    with pytest.raises(DurabilityError, match="synchronous_commit=off"):
        check_settings("postgresql", {"synchronous_commit": "off", "fsync": "on"})


def test_cli_refuses_to_start_in_memory(tmp_path: Path, tokens: TokenTable) -> None:
    tokens_file = tmp_path / "tokens.json"
    tokens.save(tokens_file)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "oma.cli.main",
            "serve",
            "session",
            "--listen",
            "127.0.0.1:0",
            "--db",
            "sqlite:///:memory:",
            "--tokens",
            str(tokens_file),
        ],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert done.returncode == 2
    assert "refusing to start" in done.stderr and "in-memory" in done.stderr


async def test_one_server_per_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'one.db'}"
    first = await open_database(url)
    try:
        with pytest.raises(DatabaseInUse, match="another session server"):
            await open_database(url)
    finally:
        await first.close()
    again = await open_database(url)  # the lock went with the first server
    await again.close()
