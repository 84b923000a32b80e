"""OAuth credentials refreshed by the vault, and MCP tool calls through the proxy against a
real MCP server (the `mcp` package, streamable HTTP) that rejects calls without the token."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import httpx
from google.protobuf.timestamp_pb2 import Timestamp
from vault_calls import create, expect_error, hosts, issue, proxy, proxy_stream
from vault_upstreams import LoopbackServer, OAuthProvider, mcp_app

from oma.vault.v1 import vault_pb2 as pb


def oauth_secret(
    provider: OAuthProvider, token_url: str, access_token: str, expires_at: float | None
) -> pb.CredentialSecret:
    secret = pb.OAuthSecret(
        access_token=access_token,
        refresh_token=provider.refresh_token,
        token_endpoint=token_url,
        client_id=provider.client_id,
        client_secret=provider.client_secret,
    )
    if expires_at is not None:
        ts = Timestamp()
        ts.FromNanoseconds(int(expires_at * 1e9))
        secret.access_token_expire_time.CopyFrom(ts)
    return pb.CredentialSecret(oauth=secret)


async def test_expired_access_token_is_refreshed_before_use(vault) -> None:
    provider = OAuthProvider()
    server = await LoopbackServer(provider.app()).start()
    try:
        stale = provider.access_token
        provider.rotate_access()  # the stored token is no longer valid upstream
        await create(
            vault.stub(),
            oauth_secret(provider, f"{server.base}/token", stale, time.time() - 60),
            hosts(("127.0.0.1", server.port)),
            credential_id="oa",
        )
        token = await issue(vault.stub(), "ses_o", "oa")
        response = await proxy(vault.stub("harness"), token, "oa", f"{server.base}/resource")
        assert response.status_code == 200
        assert provider.refreshes == 1
        # The upstream echoes the (new) access token: scrubbed.
        assert provider.access_token.encode() not in response.body
        assert b"[REDACTED]" in response.body
        listed = await vault.stub().ListCredentials(pb.ListCredentialsRequest())
        assert listed.credentials[0].access_token_expire_time.seconds > time.time()
        assert listed.credentials[0].version == 1
        # A second call uses the stored fresh token without refreshing again.
        await proxy(vault.stub("harness"), token, "oa", f"{server.base}/resource")
        assert provider.refreshes == 1
        # The upstream revokes the token early: a 401 triggers one refresh and a retry.
        provider.rotate_access()
        again = await proxy(vault.stub("harness"), token, "oa", f"{server.base}/resource")
        assert again.status_code == 200 and provider.refreshes == 2
        audit = await vault.stub().ListAudit(pb.ListAuditRequest(credential_id="oa"))
        assert [r.outcome for r in audit.records if r.action == "oauth_refresh"] == ["OK", "OK"]
    finally:
        await server.stop()


async def test_failed_refresh_is_a_clear_error(vault) -> None:
    provider = OAuthProvider()
    server = await LoopbackServer(provider.app()).start()
    try:
        secret = oauth_secret(
            provider, f"{server.base}/token", provider.access_token, time.time() - 1
        )
        provider.refresh_token = "rt-revoked-by-the-provider"
        await create(vault.stub(), secret, hosts(("127.0.0.1", server.port)), credential_id="oa")
        token = await issue(vault.stub(), "ses_o", "oa")
        exc = await expect_error(
            proxy(vault.stub("harness"), token, "oa", f"{server.base}/resource"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "REFRESH_FAILED",
        )
        assert "invalid_grant" in exc.details()
        assert provider.client_secret not in exc.details()
    finally:
        await server.stop()


def _sse_json(body: bytes) -> dict[str, Any]:
    """The JSON-RPC message of a streamable-HTTP answer (JSON or one SSE event)."""
    text = body.decode()
    if text.lstrip().startswith("{"):
        return json.loads(text)
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    return json.loads(data[-1])


async def test_mcp_tool_call_through_the_proxy(vault) -> None:
    provider = OAuthProvider()
    auth_server = await LoopbackServer(provider.app()).start()
    mcp_server = await LoopbackServer(mcp_app(lambda: provider.access_token)).start()
    try:
        url = f"{mcp_server.base}/mcp"
        # Without the token the MCP server refuses, so the test below proves injection.
        async with httpx.AsyncClient() as direct:
            refused = await direct.post(
                url,
                json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                headers={"Accept": "application/json, text/event-stream"},
            )
        assert refused.status_code == 401

        await create(
            vault.stub(),
            oauth_secret(
                provider, f"{auth_server.base}/token", provider.access_token, time.time() + 3600
            ),
            hosts(("127.0.0.1", mcp_server.port)),
            credential_id="mcp",
        )
        token = await issue(vault.stub(), "ses_m", "mcp")
        stub = vault.stub("harness")
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }

        async def rpc(message: dict[str, Any]) -> dict[str, Any]:
            response = await proxy(
                stub,
                token,
                "mcp",
                url,
                method="POST",
                headers=headers,
                body=json.dumps(message).encode(),
            )
            assert response.status_code == 200, response.body
            return _sse_json(response.body)

        init = await rpc(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "oma-vault-test", "version": "0"},
                },
            }
        )
        assert init["result"]["serverInfo"]["name"] == "vault-test"
        tools = await rpc({"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}})
        assert [t["name"] for t in tools["result"]["tools"]] == ["add"]
        called = await rpc(
            {
                "jsonrpc": "2.0",
                "id": 3,
                "method": "tools/call",
                "params": {"name": "add", "arguments": {"a": 2, "b": 40}},
            }
        )
        assert called["result"]["content"][0]["text"] == "42"
        assert called["result"].get("isError") is not True

        # The same call streamed back (server-sent events) through ProxyStream.
        head, chunks = await proxy_stream(
            stub,
            token,
            "mcp",
            url,
            method="POST",
            headers=headers,
            body=json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": 4,
                    "method": "tools/call",
                    "params": {"name": "add", "arguments": {"a": 1, "b": 1}},
                }
            ).encode(),
        )
        assert head.status_code == 200
        assert _sse_json(b"".join(chunks))["result"]["content"][0]["text"] == "2"
    finally:
        await mcp_server.stop()
        await auth_server.stop()
