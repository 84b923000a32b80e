"""Helpers of the harness tests: real servers as child processes, an in-process harness
factory and a session client."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from oma.cli._stack import _wait_for_address
from oma.harness.v1 import harness_pb2, harness_pb2_grpc
from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.runtime.server import ServerOptions
from oma.servers.harness.app import Harness, HarnessConfig, start_harness
from oma.servers.harness.driver import DriverConfig
from oma.servers.harness.loop import LoopConfig


@dataclass
class Peers:
    tokens: TokenTable
    tokens_file: Path
    session: str
    sandbox: str
    backend: str


def spawn_server(name: str, args: list[str], tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "oma.cli.main", "serve", name, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        return proc, _wait_for_address(name, proc, log, 60)
    except BaseException:
        proc.kill()
        raise


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class HarnessFactory:
    def __init__(self) -> None:
        self.started: list[Harness] = []

    async def __call__(
        self,
        peers: Peers,
        model_base_url: str,
        *,
        max_model_retries: int = 2,
        lease_ttl_seconds: float = 10.0,
    ) -> Harness:
        config = HarnessConfig(
            session_address=peers.session,
            sandbox_address=peers.sandbox,
            token=peers.tokens.token_for("harness"),
            model_base_url=model_base_url,
            driver=DriverConfig(
                lease_ttl_seconds=lease_ttl_seconds,
                loop=LoopConfig(
                    max_model_retries=max_model_retries,
                    backoff_initial_seconds=0.05,
                    backoff_max_seconds=0.2,
                ),
            ),
        )
        harness = await start_harness(config, ServerOptions(tokens=peers.tokens))
        self.started.append(harness)
        return harness


class SessionClient:
    """A client of the real session service: create, say something, wake, wait for idle."""

    def __init__(self, peers: Peers) -> None:
        from oma.runtime.client import connect
        from oma.sandbox.v1 import sandbox_pb2_grpc
        from oma.session.v1 import session_service_pb2_grpc

        self.peers = peers
        self.created: list[str] = []
        self._channels = [
            connect(peers.session, token=peers.tokens.token_for("client")),
            connect(peers.sandbox, token=peers.tokens.token_for("admin")),
        ]
        self.sessions = session_service_pb2_grpc.SessionServiceStub(self._channels[0])
        self.sandboxes = sandbox_pb2_grpc.SandboxServiceStub(self._channels[1])

    async def close(self) -> None:
        """Destroy the sandboxes of the sessions this client created, then disconnect (the
        sandboxes would otherwise outlive the test, as they outlive a session's idle)."""
        from oma.sandbox.v1 import sandbox_pb2

        for session_id in self.created:
            try:
                for sandbox in await self.sandboxes_of(session_id):
                    await self.sandboxes.DestroySandbox(
                        sandbox_pb2.DestroySandboxRequest(sandbox_id=sandbox.id)
                    )
            except grpc.aio.AioRpcError:
                pass  # the sandbox server is already gone: nothing left to clean here
        for channel in self._channels:
            await channel.close(None)

    async def create(
        self,
        script: str,
        *,
        tools: tuple[str, ...] = ("bash", "read", "write"),
        ask: tuple[str, ...] = (),
        custom_tools: tuple[str, ...] = (),
        budgets: dict[str, int] | None = None,
        prompt: str = "go",
        image: str = "",
        files: dict[str, bytes] | None = None,
    ) -> str:
        import uuid

        from oma.session.v1 import definition_pb2, events_pb2, session_service_pb2

        definition = definition_pb2.SessionDefinition(
            model="claude-sonnet-5",
            system_prompt=f"You are a test agent. [script:{script}]",
            tools=[
                definition_pb2.BuiltinTool(
                    name=t,
                    permission_policy=definition_pb2.PERMISSION_POLICY_ALWAYS_ASK
                    if t in ask
                    else definition_pb2.PERMISSION_POLICY_UNSPECIFIED,
                )
                for t in tools
            ],
            custom_tools=[
                definition_pb2.CustomTool(
                    name=name,
                    description=f"the client's {name} tool",
                    input_schema_json='{"type": "object", "properties": {"city": {"type": "string"}}}',
                )
                for name in custom_tools
            ],
            budgets=definition_pb2.Budgets(**(budgets or {})),
            environment=definition_pb2.Environment(
                image=image,
                files=[
                    definition_pb2.WorkspaceFile(path=p, content=c)
                    for p, c in (files or {}).items()
                ],
            ),
        )
        created = await self.sessions.CreateSession(
            session_service_pb2.CreateSessionRequest(
                request_id=uuid.uuid4().hex, definition=definition
            )
        )
        session_id: str = created.session.id
        self.created.append(session_id)
        await self.sessions.AppendEvents(
            session_service_pb2.AppendEventsRequest(
                session_id=session_id,
                events=[
                    events_pb2.Event(
                        id=f"user-{uuid.uuid4().hex[:8]}",
                        user_message=events_pb2.UserMessage(
                            content=[events_pb2.ContentBlock(text=f"{prompt} ({session_id})")]
                        ),
                    )
                ],
            )
        )
        return session_id

    async def wait_idle(
        self,
        session_id: str,
        *,
        limit_seconds: float = 120.0,
        on_event: object = None,
        idle_after: int = 0,
    ) -> tuple[list, list]:  # type: ignore[type-arg]
        """Follow the session from its start until a `session.status_idle` after seq
        `idle_after`; returns (events, previews)."""
        import asyncio

        from oma.session.v1 import session_service_pb2

        events: list = []  # type: ignore[type-arg]
        previews: list = []  # type: ignore[type-arg]

        async def follow() -> None:
            stream = self.sessions.StreamEvents(
                session_service_pb2.StreamEventsRequest(
                    session_id=session_id, after_seq=0, follow=True
                )
            )
            async for item in stream:
                if item.WhichOneof("item") == "preview":
                    previews.append(item.preview)
                    continue
                events.append(item.event)
                if callable(on_event):
                    await on_event(item.event)
                if item.event.type == "session.status_idle" and item.event.seq > idle_after:
                    stream.cancel()
                    return

        await asyncio.wait_for(follow(), limit_seconds)
        return events, previews

    async def say(self, session_id: str, **payload: Any) -> int:
        """Append one client event (`user_tool_confirmation=...`, `user_custom_tool_result=...`,
        `user_interrupt=...`, with `tool_use_id=` where it applies); returns its seq."""
        import uuid

        from oma.session.v1 import events_pb2, session_service_pb2

        tool_use_id = payload.pop("tool_use_id", "")
        event = events_pb2.Event(id=f"user-{uuid.uuid4().hex[:12]}", tool_use_id=tool_use_id)
        for field, value in payload.items():
            getattr(event, field).CopyFrom(value)
        response = await self.sessions.AppendEvents(
            session_service_pb2.AppendEventsRequest(session_id=session_id, events=[event])
        )
        return int(response.seqs[0])

    async def sandboxes_of(self, session_id: str, include_terminated: bool = False) -> list:  # type: ignore[type-arg]
        from oma.sandbox.v1 import sandbox_pb2

        response = await self.sandboxes.ListSandboxes(
            sandbox_pb2.ListSandboxesRequest(
                label_selector={"oma.dev/session-id": session_id},
                include_terminated=include_terminated,
            )
        )
        return list(response.sandboxes)


def types(events: list[Any]) -> list[str]:
    return [e.type for e in events]


def payload(events: list[Any], kind: str) -> list[Any]:
    return [getattr(e, kind.replace(".", "_", 1)) for e in events if e.type == kind]


async def wake(peers: Peers, address: str, session_id: str) -> harness_pb2.WakeResponse:
    async with connect(address, token=peers.tokens.token_for("client")) as channel:
        stub = harness_pb2_grpc.HarnessServiceStub(channel)
        return await stub.Wake(harness_pb2.WakeRequest(session_id=session_id))
