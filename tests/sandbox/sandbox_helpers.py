"""Helpers of the sandbox tests: a real sandbox server (gRPC over a real socket) on a real
backend — Docker or bubblewrap — and ways to call it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.runtime.errors import error_info
from oma.runtime.server import RunningServer, ServerOptions
from oma.sandbox.v1 import sandbox_pb2 as pb
from oma.sandbox.v1 import sandbox_pb2_grpc
from oma.servers.sandbox.manager import SandboxManager
from oma.servers.sandbox.model import Limits, MiB
from oma.servers.sandbox.server import build_manager, start_sandbox_server

BACKENDS = ["docker", "local"]
TEST_LIMITS = Limits(max_file_bytes=1 * MiB)


@dataclass
class SandboxServer:
    backend: str
    root: Path
    tokens: TokenTable
    manager: SandboxManager
    running: RunningServer
    channel: grpc.aio.Channel
    stub: sandbox_pb2_grpc.SandboxServiceStub

    async def provision(self, **fields: Any) -> pb.Sandbox:
        response = await self.stub.Provision(pb.ProvisionRequest(**fields))
        return response.sandbox

    async def execute(
        self, sandbox_id: str, name: str, tool_input: dict[str, Any] | str, **fields: Any
    ) -> pb.ExecuteResponse:
        text = tool_input if isinstance(tool_input, str) else json.dumps(tool_input)
        return await self.stub.Execute(
            pb.ExecuteRequest(sandbox_id=sandbox_id, name=name, input_json=text, **fields)
        )

    async def bash(self, sandbox_id: str, command: str, **fields: Any) -> pb.ExecuteResponse:
        return await self.execute(sandbox_id, "bash", {"command": command}, **fields)


def backend_fixtures(request: pytest.FixtureRequest, backend: str) -> None:
    """Skips (locally) or fails (CI) when the backend's engine is missing."""
    if backend == "docker":
        request.getfixturevalue("docker_client")
    else:
        request.getfixturevalue("bwrap_path")


async def start(
    backend: str, root: Path, *, limits: Limits = TEST_LIMITS, reaper_interval: float = 5.0
) -> SandboxServer:
    tokens = TokenTable.generate()
    manager = build_manager(backend, root, limits=limits, reaper_interval=reaper_interval)
    running = await start_sandbox_server(manager, ServerOptions(tokens=tokens))
    channel = connect(running.address, token=tokens.token_for("harness"))
    return SandboxServer(
        backend,
        root,
        tokens,
        manager,
        running,
        channel,
        sandbox_pb2_grpc.SandboxServiceStub(channel),
    )


async def stop(server: SandboxServer, *, destroy: bool = True) -> None:
    await server.channel.close()
    await server.running.stop(0)
    if destroy:
        for sandbox in list(server.manager.records.values()):
            await server.manager.destroy(sandbox.id)
    await server.manager.close()


async def run(*argv: str) -> str:
    """Runs a host command (e.g. `docker kill`) without blocking the event loop."""
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await process.communicate()
    assert process.returncode == 0, (argv, output)
    return output.decode()


def reason_of(error: grpc.aio.AioRpcError) -> str:
    info = error_info(error)
    assert info is not None, f"no ErrorInfo on {error.code()}: {error.details()}"
    assert info.domain == "oma.dev"
    return info.reason


async def expect_error(awaitable: Any, code: grpc.StatusCode, reason: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await awaitable
    assert caught.value.code() == code, caught.value.details()
    assert reason_of(caught.value) == reason, caught.value.details()
    return caught.value
