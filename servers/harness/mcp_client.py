"""An MCP client (streamable HTTP transport, JSON-RPC 2.0) over any way of sending a POST.

The harness never talks to an MCP server that needs a credential itself: each POST goes
through an `HttpExchange`, which `grpc_ports` implements with the vault's `ProxyStream` (the
vault injects the credential and scrubs it from the answer). This module knows MCP, not
gRPC: `initialize` (then `notifications/initialized`), `tools/list` with its cursor, and
`tools/call`, answered either as JSON or as server-sent events.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from oma import __version__
from oma.servers.harness.events import McpServer
from oma.servers.harness.ports import McpTool, McpUnavailable, ToolOutput

PROTOCOL_VERSION = "2025-06-18"
# Past this a result is cut, with a marker; the model's context is not a file store.
MAX_RESULT_CHARS = 100_000
MAX_LIST_PAGES = 50


@dataclass(frozen=True)
class HttpReply:
    status: int
    # Header names in lower case.
    headers: Mapping[str, str]
    body: bytes


class HttpExchange(Protocol):
    async def post(self, server: McpServer, headers: Mapping[str, str], body: bytes) -> HttpReply:
        """POST `body` to `server.url`; raise `McpUnavailable` when no answer came."""
        ...


@dataclass
class _Peer:
    """What the client keeps about one server for the connection's life."""

    session_id: str = ""
    protocol_version: str = ""
    initialized: bool = False


@dataclass
class McpClient:
    """`McpConnection` over an `HttpExchange`."""

    exchange: HttpExchange
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def list_tools(self, server: McpServer) -> list[McpTool]:
        tools: list[McpTool] = []
        cursor: str | None = None
        for _ in range(MAX_LIST_PAGES):
            params: dict[str, Any] = {"cursor": cursor} if cursor else {}
            result = await self._request(server, "tools/list", params)
            for raw in result.get("tools") or []:
                if isinstance(raw, dict) and isinstance(raw.get("name"), str):
                    tools.append(_tool(server.name, raw))
            cursor = result.get("nextCursor") or None
            if not cursor:
                return tools
        raise McpUnavailable(f"MCP server {server.name!r} lists more than {MAX_LIST_PAGES} pages")

    async def call_tool(
        self, server: McpServer, tool: str, arguments: Mapping[str, Any]
    ) -> ToolOutput:
        result = await self._request(
            server, "tools/call", {"name": tool, "arguments": dict(arguments)}
        )
        return result_output(result)

    async def close(self) -> None:
        self._peers.clear()

    async def _request(
        self, server: McpServer, method: str, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        peer = self._peers.setdefault(server.name, _Peer())
        if not peer.initialized:
            await self._initialize(server, peer)
        try:
            return await self._rpc(server, peer, method, params)
        except _SessionExpired:
            # The server forgot our MCP session (it restarted, or expired it): start anew once.
            self._peers[server.name] = peer = _Peer()
            await self._initialize(server, peer)
            return await self._rpc(server, peer, method, params)

    async def _initialize(self, server: McpServer, peer: _Peer) -> None:
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "oma-harness", "version": __version__},
        }
        result, reply = await self._exchange(server, peer, "initialize", params)
        peer.session_id = reply.headers.get("mcp-session-id", "")
        peer.protocol_version = str(result.get("protocolVersion") or PROTOCOL_VERSION)
        notified = await self.exchange.post(
            server,
            self._headers(peer),
            json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode(),
        )
        if notified.status >= 400:
            raise McpUnavailable(_http_error(server, notified))
        peer.initialized = True

    async def _rpc(
        self, server: McpServer, peer: _Peer, method: str, params: Mapping[str, Any]
    ) -> dict[str, Any]:
        result, _ = await self._exchange(server, peer, method, params)
        return result

    async def _exchange(
        self, server: McpServer, peer: _Peer, method: str, params: Mapping[str, Any]
    ) -> tuple[dict[str, Any], HttpReply]:
        request_id = next(self._ids)
        body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": dict(params)}
        reply = await self.exchange.post(server, self._headers(peer), json.dumps(body).encode())
        if reply.status == 404 and peer.session_id:
            raise _SessionExpired
        if reply.status != 200:
            raise McpUnavailable(_http_error(server, reply))
        message = _find_response(reply, request_id)
        if message is None:
            raise McpUnavailable(
                f"MCP server {server.name!r} sent no answer to {method} (request id {request_id})"
            )
        error = message.get("error")
        if error is not None:
            code = error.get("code", "") if isinstance(error, dict) else ""
            text = error.get("message", "") if isinstance(error, dict) else str(error)
            raise McpUnavailable(f"MCP server {server.name!r}: {method} failed ({code}): {text}")
        result = message.get("result")
        return (result if isinstance(result, dict) else {}), reply

    @staticmethod
    def _headers(peer: _Peer) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
        }
        if peer.session_id:
            headers["Mcp-Session-Id"] = peer.session_id
        if peer.protocol_version:
            headers["MCP-Protocol-Version"] = peer.protocol_version
        return headers


class _SessionExpired(Exception):
    pass


def _http_error(server: McpServer, reply: HttpReply) -> str:
    text = reply.body[:300].decode("utf-8", "replace").strip()
    return f"MCP server {server.name!r} answered HTTP {reply.status}" + (
        f": {text}" if text else ""
    )


def _messages(reply: HttpReply) -> list[Any]:
    """The JSON-RPC messages of a streamable-HTTP answer: one JSON body, or SSE `data:`."""
    text = reply.body.decode("utf-8", "replace")
    if "text/event-stream" not in reply.headers.get("content-type", ""):
        try:
            decoded = json.loads(text)
        except ValueError:
            return []
        return decoded if isinstance(decoded, list) else [decoded]
    out: list[Any] = []
    data: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            try:
                out.append(json.loads("\n".join(data)))
            except ValueError:
                pass  # a non-JSON event (a keep-alive) carries no answer
            data = []
    return out


def _find_response(reply: HttpReply, request_id: int) -> dict[str, Any] | None:
    for message in _messages(reply):
        if (
            isinstance(message, dict)
            and message.get("id") == request_id
            and ("result" in message or "error" in message)
        ):
            return message
    return None


def _tool(server: str, raw: Mapping[str, Any]) -> McpTool:
    annotations = raw.get("annotations") if isinstance(raw.get("annotations"), dict) else {}
    assert isinstance(annotations, dict)
    schema = raw.get("inputSchema")
    return McpTool(
        server=server,
        name=str(raw["name"]),
        description=str(raw.get("description") or raw.get("title") or ""),
        input_schema=schema if isinstance(schema, dict) else {"type": "object"},
        safe_to_repeat=bool(
            annotations.get("readOnlyHint") is True or annotations.get("idempotentHint") is True
        ),
    )


def result_output(result: Mapping[str, Any]) -> ToolOutput:
    """A `tools/call` result as the text the model sees (non-text content is named, not
    inlined), and whether the tool reported an error."""
    parts: list[str] = []
    for block in result.get("content") or []:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} content ({block.get('mimeType', 'unknown type')}) not shown]")
        elif kind == "resource":
            resource = block.get("resource") if isinstance(block.get("resource"), dict) else {}
            assert isinstance(resource, dict)
            parts.append(str(resource.get("text") or f"[resource {resource.get('uri', '')}]"))
        elif kind == "resource_link":
            parts.append(f"[resource link {block.get('uri', '')}]")
        else:
            parts.append(json.dumps(block))
    if not parts and result.get("structuredContent") is not None:
        parts.append(json.dumps(result["structuredContent"]))
    text = "\n".join(parts)
    if len(text) > MAX_RESULT_CHARS:
        text = (
            text[:MAX_RESULT_CHARS]
            + f"\n[output truncated: {len(text)} characters in all, first {MAX_RESULT_CHARS} shown]"
        )
    return ToolOutput(text, bool(result.get("isError")))
