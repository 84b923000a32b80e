"""The loop's ports over the OMA contracts: `SessionService` and `SandboxService` stubs.

This is the one place that knows both the harness's event view and the wire format; it maps
status codes and `ErrorInfo` reasons to the port exceptions the loop understands, and retries
calls that the contracts declare safe to retry (appends with the same ids, executions with
the same execution id, provisions with the same request id).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2

from oma.runtime.errors import error_info
from oma.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from oma.servers.harness import events as ev
from oma.servers.harness import tools
from oma.servers.harness.events import (
    Definition,
    Environment,
    LogEvent,
    McpServer,
    NewEvent,
    ToolSpec,
    Usage,
)
from oma.servers.harness.mcp_client import HttpReply, McpClient
from oma.servers.harness.ports import (
    Lease,
    LeaseHeld,
    LeaseLost,
    McpUnavailable,
    SandboxGone,
    SessionGone,
    ToolFailed,
    ToolOutput,
    Unreachable,
)
from oma.session.v1 import (
    definition_pb2,
    events_pb2,
    session_service_pb2,
    session_service_pb2_grpc,
)

T = TypeVar("T")

SESSION_LABEL = "oma.dev/session-id"
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}

_STOP_REASONS = {
    ev.STOP_END_TURN: events_pb2.STOP_REASON_END_TURN,
    ev.STOP_REQUIRES_ACTION: events_pb2.STOP_REASON_REQUIRES_ACTION,
    ev.STOP_RETRIES_EXHAUSTED: events_pb2.STOP_REASON_RETRIES_EXHAUSTED,
    ev.STOP_BUDGET_REACHED: events_pb2.STOP_REASON_BUDGET_REACHED,
}
_STOP_NAMES = {v: k for k, v in _STOP_REASONS.items()}


def _reason(error: grpc.aio.AioRpcError) -> str:
    info = error_info(error)
    return info.reason if info is not None else ""


async def _retrying(call: Callable[[], Awaitable[T]], attempts: int = 5) -> T:
    """Retry a call the contract declares safe to repeat, on transient transport failures."""
    for attempt in range(attempts):
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if error.code() not in _TRANSIENT or attempt == attempts - 1:
                raise
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
    raise AssertionError("unreachable")


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromMilliseconds(int(seconds * 1000))
    return d


def _text(blocks: Sequence[events_pb2.ContentBlock]) -> str:
    return "\n".join(b.text for b in blocks if b.WhichOneof("block") == "text")


def _blocks(text: str) -> list[events_pb2.ContentBlock]:
    return [events_pb2.ContentBlock(text=text)]


def to_log_event(event: events_pb2.Event) -> LogEvent:
    """The harness's view of a stored event (payload fields it does not use are dropped)."""
    kind = event.WhichOneof("payload")
    base: dict[str, Any] = {
        "seq": event.seq,
        "id": event.id,
        "type": event.type,
        "tool_use_id": event.tool_use_id,
    }
    if kind == "user_message":
        base["text"] = _text(event.user_message.content)
    elif kind == "agent_message":
        base["text"] = _text(event.agent_message.content)
    elif kind in ("agent_tool_use", "agent_custom_tool_use"):
        use = getattr(event, kind)
        base["tool_name"] = use.name
        try:
            parsed = json.loads(use.input_json or "{}")
        except ValueError:
            parsed = {}
        base["tool_input"] = parsed if isinstance(parsed, dict) else {}
    elif kind == "agent_mcp_tool_use":
        use = event.agent_mcp_tool_use
        base["tool_name"] = tools.mcp_tool_name(use.server_name, use.name)
        base["mcp_server"] = use.server_name
        base["mcp_tool"] = use.name
        try:
            parsed = json.loads(use.input_json or "{}")
        except ValueError:
            parsed = {}
        base["tool_input"] = parsed if isinstance(parsed, dict) else {}
    elif kind == "agent_mcp_tool_result":
        base["text"] = _text(event.agent_mcp_tool_result.content)
        base["is_error"] = event.agent_mcp_tool_result.is_error
    elif kind == "user_custom_tool_result":
        base["text"] = _text(event.user_custom_tool_result.content)
        base["is_error"] = event.user_custom_tool_result.is_error
    elif kind == "user_tool_confirmation":
        confirmation = event.user_tool_confirmation
        base["allowed"] = confirmation.result == events_pb2.TOOL_CONFIRMATION_RESULT_ALLOW
        base["text"] = confirmation.deny_message
    elif kind == "agent_tool_result":
        base["text"] = _text(event.agent_tool_result.content)
        base["is_error"] = event.agent_tool_result.is_error
    elif kind == "session_status_idle":
        base["stop_reason"] = _STOP_NAMES.get(event.session_status_idle.stop_reason, "")
    elif kind == "span_model_request_end":
        u = event.span_model_request_end.usage
        base["usage"] = Usage(
            u.input_tokens,
            u.output_tokens,
            u.cache_read_input_tokens,
            u.cache_creation_input_tokens,
        )
        base["is_error"] = event.span_model_request_end.is_error
    return LogEvent(**base)


def to_proto_event(event: NewEvent) -> events_pb2.Event:
    out = events_pb2.Event(id=event.id, turn_id=event.turn_id, tool_use_id=event.tool_use_id)
    t = event.type
    if t == ev.AGENT_MESSAGE:
        out.agent_message.CopyFrom(events_pb2.AgentMessage(content=_blocks(event.text)))
    elif t == ev.AGENT_TOOL_USE:
        out.agent_tool_use.CopyFrom(
            events_pb2.AgentToolUse(
                name=event.tool_name, input_json=json.dumps(dict(event.tool_input))
            )
        )
    elif t == ev.AGENT_CUSTOM_TOOL_USE:
        out.agent_custom_tool_use.CopyFrom(
            events_pb2.AgentCustomToolUse(
                name=event.tool_name, input_json=json.dumps(dict(event.tool_input))
            )
        )
    elif t == ev.AGENT_MCP_TOOL_USE:
        out.agent_mcp_tool_use.CopyFrom(
            events_pb2.AgentMcpToolUse(
                server_name=event.mcp_server,
                name=event.mcp_tool,
                input_json=json.dumps(dict(event.tool_input)),
            )
        )
    elif t == ev.AGENT_MCP_TOOL_RESULT:
        out.agent_mcp_tool_result.CopyFrom(
            events_pb2.AgentMcpToolResult(content=_blocks(event.text), is_error=event.is_error)
        )
    elif t == ev.AGENT_TOOL_RESULT:
        out.agent_tool_result.CopyFrom(
            events_pb2.AgentToolResult(content=_blocks(event.text), is_error=event.is_error)
        )
    elif t == ev.STATUS_RUNNING:
        out.session_status_running.SetInParent()
    elif t == ev.STATUS_IDLE:
        out.session_status_idle.CopyFrom(
            events_pb2.SessionStatusIdle(
                stop_reason=_STOP_REASONS[event.stop_reason], tool_use_ids=event.tool_use_ids
            )
        )
    elif t == ev.STATUS_RESCHEDULED:
        out.session_status_rescheduled.CopyFrom(
            events_pb2.SessionStatusRescheduled(reason=event.text)
        )
    elif t == ev.SESSION_ERROR:
        out.session_error.CopyFrom(
            events_pb2.SessionError(code=event.code, message=event.text, retrying=event.retrying)
        )
    elif t == ev.SPAN_START:
        out.span_model_request_start.CopyFrom(events_pb2.SpanModelRequestStart(model=event.model))
    elif t == ev.SPAN_END:
        u = event.usage
        out.span_model_request_end.CopyFrom(
            events_pb2.SpanModelRequestEnd(
                usage=events_pb2.Usage(
                    input_tokens=u.input_tokens,
                    output_tokens=u.output_tokens,
                    cache_read_input_tokens=u.cache_read_input_tokens,
                    cache_creation_input_tokens=u.cache_creation_input_tokens,
                ),
                is_error=event.is_error,
            )
        )
    else:
        raise ValueError(f"the harness does not write {t} events")
    return out


def to_definition(d: definition_pb2.SessionDefinition) -> Definition:
    ask = definition_pb2.PERMISSION_POLICY_ALWAYS_ASK
    specs = [ToolSpec(t.name, ask=t.permission_policy == ask) for t in d.tools]
    for c in d.custom_tools:
        schema = json.loads(c.input_schema_json) if c.input_schema_json else {"type": "object"}
        specs.append(ToolSpec(c.name, c.description, schema, custom=True))
    b = d.budgets
    e = d.environment
    r = e.resources
    environment = Environment(
        image=e.image,
        cpu_millis=r.cpu_millis,
        memory_bytes=r.memory_bytes,
        disk_bytes=r.disk_bytes,
        pids=r.pids,
        lifetime_seconds=r.lifetime.ToTimedelta().total_seconds(),
        allowed_hosts=tuple(e.network.allowed_hosts)
        if e.network.mode == definition_pb2.NETWORK_MODE_ALLOW_LIST
        else (),
        files=tuple((f.path, f.content, f.mode) for f in e.files),
        repositories=tuple((r.url, r.ref, r.path, r.vault_credential_id) for r in e.repositories),
    )
    return Definition(
        environment=environment,
        model=d.model,
        system=d.system_prompt,
        tools=tuple(specs),
        max_output_tokens_per_turn=b.max_output_tokens_per_turn,
        max_total_tokens=b.max_total_tokens,
        max_model_calls_per_turn=b.max_model_calls_per_turn,
        max_turns=b.max_turns,
        mcp_servers=tuple(
            McpServer(m.name, m.url, m.vault_credential_id, m.permission_policy == ask)
            for m in d.mcp_servers
        ),
        vault_credential_ids=tuple(d.vault_credential_ids),
    )


class GrpcSession:
    """`SessionPort` over `oma.session.v1.SessionService`."""

    def __init__(self, channel: grpc.aio.Channel, page_size: int = 500) -> None:
        self._stub = session_service_pb2_grpc.SessionServiceStub(channel)
        self._page_size = page_size

    def _session_error(self, error: grpc.aio.AioRpcError, session_id: str) -> Exception:
        reason = _reason(error)
        if reason == "SESSION_NOT_FOUND":
            return SessionGone(f"no session has id {session_id!r}", terminated=False)
        if reason == "SESSION_TERMINATED":
            return SessionGone(f"session {session_id!r} is terminated", terminated=True)
        if reason == "LEASE_LOST":
            return LeaseLost(error.details() or "lease lost")
        if error.code() in _TRANSIENT:
            return Unreachable(f"the session service is unreachable: {error.details()}")
        return error

    async def acquire_lease(self, session_id: str, holder_id: str, ttl_seconds: float) -> Lease:
        request = session_service_pb2.AcquireLeaseRequest(
            session_id=session_id, holder_id=holder_id, ttl=_duration(ttl_seconds)
        )
        try:
            response = await _retrying(lambda: self._stub.AcquireLease(request))
        except grpc.aio.AioRpcError as error:
            if _reason(error) == "LEASE_HELD":
                info = error_info(error)
                raise LeaseHeld(info.metadata.get("holder_id", "") if info else "") from error
            raise self._session_error(error, session_id) from error
        return Lease(
            session_id, response.lease.holder_id, response.lease.fencing_token, ttl_seconds
        )

    async def renew_lease(self, lease: Lease) -> Lease:
        request = session_service_pb2.RenewLeaseRequest(
            session_id=lease.session_id,
            fencing_token=lease.fencing_token,
            ttl=_duration(lease.ttl_seconds),
        )
        try:
            await self._stub.RenewLease(request)
        except grpc.aio.AioRpcError as error:
            if error.code() in (
                grpc.StatusCode.ABORTED,
                grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.NOT_FOUND,
            ):
                raise LeaseLost(error.details() or "lease lost") from error
            raise
        return lease

    async def release_lease(self, lease: Lease) -> None:
        await self._stub.ReleaseLease(
            session_service_pb2.ReleaseLeaseRequest(
                session_id=lease.session_id, fencing_token=lease.fencing_token
            )
        )

    async def definition(self, session_id: str) -> Definition:
        try:
            response = await _retrying(
                lambda: self._stub.GetSession(
                    session_service_pb2.GetSessionRequest(session_id=session_id)
                )
            )
        except grpc.aio.AioRpcError as error:
            raise self._session_error(error, session_id) from error
        return to_definition(response.session.definition)

    async def read_events(self, session_id: str, after_seq: int) -> list[LogEvent]:
        out: list[LogEvent] = []
        token = ""
        while True:
            request = session_service_pb2.GetEventsRequest(
                session_id=session_id,
                after_seq=after_seq,
                page_size=self._page_size,
                order=session_service_pb2.EVENT_ORDER_ASCENDING,
                page_token=token,
            )
            try:
                response = await _retrying(partial(self._stub.GetEvents, request))
            except grpc.aio.AioRpcError as error:
                raise self._session_error(error, session_id) from error
            out.extend(to_log_event(e) for e in response.events)
            token = response.next_page_token
            if not token:
                return out

    async def read_slice(
        self,
        session_id: str,
        *,
        after_seq: int,
        before_seq: int,
        limit: int,
        newest_first: bool,
        types: Sequence[str],
    ) -> list[LogEvent]:
        """One `GetEvents` page: at most `limit` events between the seqs (positional slices
        for a context policy, `SessionSlices`)."""
        order = (
            session_service_pb2.EVENT_ORDER_DESCENDING
            if newest_first
            else session_service_pb2.EVENT_ORDER_ASCENDING
        )
        request = session_service_pb2.GetEventsRequest(
            session_id=session_id,
            after_seq=after_seq,
            before_seq=before_seq,
            page_size=limit,
            order=order,
            types=list(types),
        )
        try:
            response = await _retrying(partial(self._stub.GetEvents, request))
        except grpc.aio.AioRpcError as error:
            raise self._session_error(error, session_id) from error
        return [to_log_event(e) for e in response.events]

    async def append(self, lease: Lease, events: Sequence[NewEvent]) -> list[int]:
        request = session_service_pb2.AppendEventsRequest(
            session_id=lease.session_id,
            events=[to_proto_event(e) for e in events],
            fencing_token=lease.fencing_token,
        )
        try:
            # Same ids on every attempt: a repeat of a batch that was stored is a no-op.
            response = await _retrying(lambda: self._stub.AppendEvents(request))
        except grpc.aio.AioRpcError as error:
            raise self._session_error(error, lease.session_id) from error
        return list(response.seqs)

    async def follow(self, session_id: str, after_seq: int) -> AsyncIterator[LogEvent]:
        call = self._stub.StreamEvents(
            session_service_pb2.StreamEventsRequest(
                session_id=session_id, after_seq=after_seq, follow=True
            )
        )
        try:
            async for item in call:
                if item.WhichOneof("item") == "event":
                    yield to_log_event(item.event)
        finally:
            call.cancel()

    async def publish_preview(self, lease: Lease, after_seq: int, text: str) -> None:
        await self._stub.PublishPreview(
            session_service_pb2.PublishPreviewRequest(
                session_id=lease.session_id,
                fencing_token=lease.fencing_token,
                preview=session_service_pb2.Preview(
                    session_id=lease.session_id, after_seq=after_seq, text_delta=text
                ),
            )
        )


class GrpcVault:
    """The one vault call the harness makes: a session-scoped token, never a secret."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        from oma.vault.v1 import vault_pb2_grpc

        self._stub = vault_pb2_grpc.VaultServiceStub(channel)

    async def issue_session_token(self, session_id: str, credential_ids: Sequence[str]) -> str:
        from oma.vault.v1 import vault_pb2

        request = vault_pb2.IssueSessionTokenRequest(
            session_id=session_id, credential_ids=list(credential_ids)
        )
        try:
            response = await _retrying(lambda: self._stub.IssueSessionToken(request))
        except grpc.aio.AioRpcError as error:
            raise ToolFailed(
                f"the vault refused a session token ({_reason(error) or error.code().name}: "
                f"{error.details()})"
            ) from error
        return str(response.session_token)

    async def proxy_stream(
        self,
        session_token: str,
        credential_id: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes,
        timeout_seconds: float,
    ) -> HttpReply:
        """POST through `ProxyStream` (the vault injects the credential); the whole scrubbed
        answer. Raises `grpc.aio.AioRpcError` as the vault answered."""
        from oma.vault.v1 import vault_pb2

        request = vault_pb2.ProxyStreamRequest(
            session_token=session_token,
            credential_id=credential_id,
            request=vault_pb2.HttpRequest(
                method="POST",
                url=url,
                headers=[vault_pb2.HttpHeader(name=k, value=v) for k, v in headers.items()],
                body=body,
            ),
            timeout=_duration(timeout_seconds),
        )
        status = 0
        reply_headers: dict[str, str] = {}
        chunks: list[bytes] = []
        async for part in self._stub.ProxyStream(request):
            if part.WhichOneof("part") == "head":
                status = part.head.status_code
                reply_headers = {h.name.lower(): h.value for h in part.head.headers}
            else:
                chunks.append(part.body_chunk)
        return HttpReply(status, reply_headers, b"".join(chunks))


class _SessionExchange:
    """POSTs to one session's MCP servers: through the vault's proxy with a session token
    when the server has a credential, directly otherwise."""

    def __init__(
        self, vault: GrpcVault | None, session_id: str, definition: Definition, timeout: float
    ) -> None:
        self._vault = vault
        self._session_id = session_id
        # VAULT-TOKEN-003: a harness gets a token only for credentials the definition lists.
        self._granted = set(definition.vault_credential_ids)
        self._credentials = sorted(
            {m.credential_id for m in definition.mcp_servers} & self._granted
        )
        self._timeout = timeout
        self._token = ""

    async def _session_token(self, renew: bool = False) -> str:
        assert self._vault is not None
        if renew or not self._token:
            try:
                self._token = await self._vault.issue_session_token(
                    self._session_id, self._credentials
                )
            except ToolFailed as error:
                raise McpUnavailable(str(error)) from error
        return self._token

    async def post(self, server: McpServer, headers: Mapping[str, str], body: bytes) -> HttpReply:
        if not server.credential_id:
            return await self._direct(server, headers, body)
        if self._vault is None:
            raise McpUnavailable(
                f"MCP server {server.name!r} needs vault credential {server.credential_id!r}, "
                "but this harness was started without --vault"
            )
        if server.credential_id not in self._granted:
            raise McpUnavailable(
                f"MCP server {server.name!r} needs vault credential {server.credential_id!r}, "
                "which the session's definition does not list in vault_credential_ids"
            )
        for attempt in range(2):
            token = await self._session_token(renew=attempt > 0)
            try:
                return await self._vault.proxy_stream(
                    token, server.credential_id, server.url, headers, body, self._timeout
                )
            except grpc.aio.AioRpcError as error:
                reason = _reason(error) or error.code().name
                if reason == "SESSION_TOKEN_INVALID" and attempt == 0:
                    continue  # expired mid-turn: one fresh token
                if error.code() in _TRANSIENT:
                    raise McpUnavailable(
                        f"MCP server {server.name!r} is unreachable ({reason}: {error.details()})"
                    ) from error
                raise McpUnavailable(
                    f"the vault refused the call to MCP server {server.name!r} ({reason}: "
                    f"{error.details()})"
                ) from error
        raise AssertionError("unreachable")

    async def _direct(
        self, server: McpServer, headers: Mapping[str, str], body: bytes
    ) -> HttpReply:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=self._timeout, trust_env=False) as client:
                response = await client.post(server.url, headers=dict(headers), content=body)
        except httpx.HTTPError as error:
            raise McpUnavailable(
                f"MCP server {server.name!r} is unreachable ({type(error).__name__}: {error})"
            ) from error
        return HttpReply(
            response.status_code,
            {k.lower(): v for k, v in response.headers.items()},
            response.content,
        )


class GrpcMcp:
    """`McpPort`: MCP clients whose requests go through the vault (see `_SessionExchange`)."""

    def __init__(self, vault: GrpcVault | None, timeout_seconds: float = 120.0) -> None:
        self._vault = vault
        self._timeout = timeout_seconds

    def connect(self, session_id: str, definition: Definition) -> McpClient:
        return McpClient(_SessionExchange(self._vault, session_id, definition, self._timeout))


class GrpcSandbox:
    """`SandboxPort` over `oma.sandbox.v1.SandboxService`."""

    def __init__(self, channel: grpc.aio.Channel, vault: GrpcVault | None = None) -> None:
        self._stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        self._vault = vault

    async def find_live(self, session_id: str) -> str | None:
        request = sandbox_pb2.ListSandboxesRequest(label_selector={SESSION_LABEL: session_id})
        try:
            response = await _retrying(lambda: self._stub.ListSandboxes(request))
        except grpc.aio.AioRpcError as error:
            raise ToolFailed(
                f"the sandbox service failed ({error.code().name}: {error.details()})"
            ) from error
        ready = [s for s in response.sandboxes if s.state == sandbox_pb2.SANDBOX_STATE_READY]
        # The newest one: older ones were replaced after a loss.
        return ready[-1].id if ready else None

    async def provision(self, session_id: str, request_id: str, environment: Environment) -> str:
        e = environment
        resources = sandbox_pb2.Resources(
            cpu_millis=e.cpu_millis,
            memory_bytes=e.memory_bytes,
            disk_bytes=e.disk_bytes,
            pids=e.pids,
        )
        if e.lifetime_seconds:
            resources.lifetime.CopyFrom(_duration(e.lifetime_seconds))
        network = sandbox_pb2.NetworkPolicy(mode=sandbox_pb2.NETWORK_MODE_NONE)
        if e.allowed_hosts:
            network = sandbox_pb2.NetworkPolicy(
                mode=sandbox_pb2.NETWORK_MODE_ALLOW_LIST, allowed_hosts=list(e.allowed_hosts)
            )
        request = sandbox_pb2.ProvisionRequest(
            request_id=request_id,
            labels={SESSION_LABEL: session_id},
            resources=resources,
            image=e.image,
            network=network,
            init=sandbox_pb2.InitSteps(
                files=[sandbox_pb2.InitFile(path=p, content=c, mode=m) for p, c, m in e.files],
                repositories=[
                    sandbox_pb2.GitRepository(url=u, ref=r, path=p, credential_id=c)
                    for u, r, p, c in e.repositories
                ],
            ),
        )
        credential_ids = sorted({c for _, _, _, c in e.repositories if c})
        if credential_ids:
            # The sandbox server clones through the vault with this token; the harness never
            # sees the git credential itself.
            if self._vault is None:
                raise ToolFailed(
                    "the session's repositories need vault credentials, but this "
                    "harness was started without --vault"
                )
            request.vault_session_token = await self._vault.issue_session_token(
                session_id, credential_ids
            )
        try:
            response = await _retrying(lambda: self._stub.Provision(request), attempts=3)
        except grpc.aio.AioRpcError as error:
            reason = _reason(error) or error.code().name
            raise ToolFailed(
                f"no sandbox could be provisioned ({reason}: {error.details()})"
            ) from error
        return str(response.sandbox.id)

    async def execute(
        self, sandbox_id: str, name: str, tool_input: Mapping[str, Any], execution_id: str
    ) -> ToolOutput:
        request = sandbox_pb2.ExecuteRequest(
            sandbox_id=sandbox_id,
            name=name,
            input_json=json.dumps(dict(tool_input)),
            execution_id=execution_id,
        )
        try:
            response = await _retrying(lambda: self._stub.Execute(request))
        except grpc.aio.AioRpcError as error:
            reason = _reason(error)
            if reason in ("SANDBOX_TERMINATED", "SANDBOX_NOT_FOUND"):
                raise SandboxGone(error.details() or reason) from error
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # Bad input from the model is the model's to fix: show it the message.
                return ToolOutput(f"{reason or 'INVALID_ARGUMENT'}: {error.details()}", True)
            raise ToolFailed(
                f"the sandbox service failed ({reason or error.code().name}: {error.details()})"
            ) from error
        return ToolOutput(response.output, response.is_error)

    async def destroy(self, sandbox_id: str) -> None:
        try:
            await self._stub.DestroySandbox(
                sandbox_pb2.DestroySandboxRequest(sandbox_id=sandbox_id)
            )
        except grpc.aio.AioRpcError:
            pass  # best-effort: the dead sandbox's own record expires
