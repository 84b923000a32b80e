"""MCP tools end to end: a real MCP server (the `mcp` package, streamable HTTP) that demands an
OAuth token, the token stored in a real vault (started with `--session`), the harness as its
own process calling the server through the vault's proxy with a session token only.

Requirements tested: HARNESS-MCP-001, HARNESS-MCP-003, HARNESS-CRED-001.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness_helpers import Peers, SessionClient, payload, spawn_server, stop_server, types, wake
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).parent.parent / "vault"))

from vault_calls import create, hosts
from vault_upstreams import LoopbackServer, OAuthProvider, mcp_app

from oma.harness.v1 import harness_pb2
from oma.runtime.client import connect
from oma.servers.harness.model_server.server import (
    AsyncModelServer,
    start_model_server,
)
from oma.session.v1 import definition_pb2, events_pb2, session_service_pb2
from oma.vault.v1 import vault_pb2, vault_pb2_grpc

SCRIPTS: dict[str, Any] = {
    "scripts": {
        "mcp": {
            "turns": [
                {
                    "content": [
                        {"type": "text", "text": "Let me add these."},
                        {"type": "tool_use", "name": "calc__add", "input": {"a": 2, "b": 40}},
                        {"type": "tool_use", "name": "calc__add", "input": {"a": "two"}},
                    ]
                },
                {"text": "2 + 40 = 42."},
            ]
        }
    }
}


class Recorder:
    """ASGI wrapper that remembers the `Authorization` header of every request it passes on."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.authorizations: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            self.authorizations.append(headers.get(b"authorization", b"").decode())
        await self.app(scope, receive, send)


def recording_proxy(upstream: str, bodies: list[dict[str, Any]]) -> Starlette:
    """Passes Messages API requests on to the scripted model server, keeping their bodies, so
    the test can see what the model was shown."""

    async def forward(request: Request) -> Response:
        body = await request.body()
        if body:
            bodies.append(json.loads(body))
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        }
        async with httpx.AsyncClient(timeout=60) as client:
            answer = await client.request(
                request.method, f"{upstream}{request.url.path}", headers=headers, content=body
            )
        dropped = ("content-length", "content-encoding", "transfer-encoding", "connection")
        return Response(
            answer.content,
            status_code=answer.status_code,
            headers={k: v for k, v in answer.headers.items() if k.lower() not in dropped},
        )

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


@pytest.fixture
def vault_address(tmp_path: Path, tokens_file: Path, session_address: str) -> Iterator[str]:
    proc, address = spawn_server(
        "vault",
        [
            "--listen",
            "127.0.0.1:0",
            "--grace-seconds",
            "1",
            "--tokens",
            str(tokens_file),
            "--db",
            f"sqlite+aiosqlite:///{tmp_path / 'vault.db'}",
            "--key-file",
            str(tmp_path / "vault.key"),
            "--session",
            session_address,
        ],
        tmp_path,
    )
    yield address
    stop_server(proc)


@pytest.fixture
async def model() -> AsyncIterator[AsyncModelServer]:
    async with await start_model_server(SCRIPTS) as server:
        yield server
        assert server.rejections() == []


async def test_the_model_calls_an_mcp_tool_through_the_vault(
    tmp_path: Path,
    local_peers: Peers,
    local_client: SessionClient,
    vault_address: str,
    model: AsyncModelServer,
) -> None:
    provider = OAuthProvider()
    auth_server = await LoopbackServer(provider.app()).start()
    recorder = Recorder(mcp_app(lambda: provider.access_token))
    mcp_server = await LoopbackServer(recorder).start()
    bodies: list[dict[str, Any]] = []
    model_proxy = await LoopbackServer(recording_proxy(model.base_url, bodies)).start()
    harness = None
    vault_channel = connect(vault_address, token=local_peers.tokens.token_for("admin"))
    try:
        secret = vault_pb2.OAuthSecret(
            access_token=provider.access_token,
            refresh_token=provider.refresh_token,
            token_endpoint=f"{auth_server.base}/token",
            client_id=provider.client_id,
            client_secret=provider.client_secret,
        )
        secret.access_token_expire_time.FromSeconds(int(time.time()) + 3600)
        await create(
            vault_pb2_grpc.VaultServiceStub(vault_channel),
            vault_pb2.CredentialSecret(oauth=secret),
            hosts(("127.0.0.1", mcp_server.port)),
            credential_id="calc-oauth",
        )
        secrets = [provider.access_token, provider.refresh_token, provider.client_secret]

        definition = definition_pb2.SessionDefinition(
            model="claude-sonnet-5",
            system_prompt="You are a test agent. [script:mcp]",
            mcp_servers=[
                definition_pb2.McpServer(
                    name="calc", url=f"{mcp_server.base}/mcp", vault_credential_id="calc-oauth"
                ),
                # The credential does not allow this host: the vault's proxy refuses it.
                definition_pb2.McpServer(
                    name="elsewhere",
                    url=f"{auth_server.base}/mcp",
                    vault_credential_id="calc-oauth",
                ),
            ],
            vault_credential_ids=["calc-oauth"],
        )
        created = await local_client.sessions.CreateSession(
            session_service_pb2.CreateSessionRequest(
                request_id=uuid.uuid4().hex, definition=definition
            )
        )
        session_id = created.session.id
        local_client.created.append(session_id)
        await local_client.say(
            session_id,
            user_message=events_pb2.UserMessage(content=[events_pb2.ContentBlock(text="add")]),
        )

        harness, harness_address = spawn_server(
            "harness",
            [
                "--listen",
                "127.0.0.1:0",
                "--grace-seconds",
                "1",
                "--tokens",
                str(local_peers.tokens_file),
                "--session",
                local_peers.session,
                "--sandbox",
                local_peers.sandbox,
                "--vault",
                vault_address,
                "--model-base-url",
                model_proxy.base,
            ],
            tmp_path,
        )
        waiting = local_client.wait_idle(session_id)
        woken = await wake(local_peers, harness_address, session_id)
        assert woken.outcome == harness_pb2.WAKE_OUTCOME_STARTED
        events, _ = await waiting

        kinds = types(events)
        assert "agent.tool_use" not in kinds and "agent.tool_result" not in kinds
        uses = payload(events, "agent.mcp_tool_use")
        assert [(u.server_name, u.name) for u in uses] == [("calc", "add"), ("calc", "add")]
        assert json.loads(uses[0].input_json) == {"a": 2, "b": 40}
        results = {
            e.tool_use_id: e.agent_mcp_tool_result
            for e in events
            if e.type == "agent.mcp_tool_result"
        }
        good, bad = (e.tool_use_id for e in events if e.type == "agent.mcp_tool_use")
        assert results[good].content[0].text == "42" and not results[good].is_error
        # Bad input is the MCP tool's error, shown to the model, not the end of the turn.
        assert results[bad].is_error
        # The server the credential does not allow is reported, and its tools not offered.
        (refused,) = [e.session_error for e in events if e.type == "session.error"]
        assert refused.code == "mcp_unavailable" and "HOST_NOT_ALLOWED" in refused.message
        assert payload(events, "agent.message")[-1].content[0].text == "2 + 40 = 42."
        assert events[-1].session_status_idle.stop_reason == events_pb2.STOP_REASON_END_TURN

        # The model was offered the namespaced tool, and its second request held the results.
        assert [t["name"] for t in bodies[0]["tools"]] == ["calc__add"]
        answered = [
            block
            for message in bodies[-1]["messages"]
            if message["role"] == "user" and isinstance(message["content"], list)
            for block in message["content"]
            if block.get("type") == "tool_result"
        ]
        assert [(b["tool_use_id"], b["is_error"]) for b in answered] == [
            (good, False),
            (bad, True),
        ]
        assert answered[0]["content"] == "42"

        # The MCP server saw the OAuth token on every request; neither the harness process
        # nor the log ever held it.
        assert recorder.authorizations
        assert set(recorder.authorizations) == {f"Bearer {provider.access_token}"}
        environ = await asyncio.to_thread(Path(f"/proc/{harness.pid}/environ").read_bytes)
        cmdline = await asyncio.to_thread(Path(f"/proc/{harness.pid}/cmdline").read_bytes)
        log = b"".join(e.SerializeToString() for e in events)
        for secret_text in secrets:
            for where in (environ, cmdline, log, json.dumps(bodies).encode()):
                assert secret_text.encode() not in where
        # MCP tools need no sandbox.
        assert await local_client.sandboxes_of(session_id, include_terminated=True) == []
    finally:
        if harness is not None:
            stop_server(harness)
        await vault_channel.close()
        await model_proxy.stop()
        await mcp_server.stop()
        await auth_server.stop()
