"""Channels to OMA servers: bearer token, W3C trace context, TLS/mTLS, limits, keepalive.

`connect(address, token=..., tls=None)` returns a `grpc.aio.Channel` whose every call
carries `authorization: Bearer <token>` (when a token is given) and a `traceparent` that
continues the current trace (`oma.runtime.trace`) — inside a server handler that is the
caller's trace, so a chain of OMA calls shares one trace id ([COMMON-TRACE-001]).
`address` is anything gRPC dials: `host:port`, `unix:/path`, `dns:///name:port`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from oma.runtime import trace

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class ClientTls:
    """Trust `ca` (PEM; None: the system roots); present `cert`/`key` for mTLS.
    `server_name` overrides the name checked against the server certificate."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both cert and key")
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.ca).read_bytes() if self.ca else None,
            private_key=Path(self.key).read_bytes() if self.key else None,
            certificate_chain=Path(self.cert).read_bytes() if self.cert else None,
        )


def _with_metadata(details: aio.ClientCallDetails, token: str | None) -> aio.ClientCallDetails:
    metadata = aio.Metadata(*(details.metadata or ()))
    # A traceparent the caller put on this call by hand wins over the contextvar.
    if trace.TRACEPARENT not in metadata:
        ctx = trace.outgoing()
        metadata.add(trace.TRACEPARENT, ctx.traceparent)
        if ctx.tracestate and trace.TRACESTATE not in metadata:
            metadata.add(trace.TRACESTATE, ctx.tracestate)
    if token is not None and "authorization" not in metadata:
        metadata.add("authorization", f"Bearer {token}")
    return aio.ClientCallDetails(
        method=details.method,
        timeout=details.timeout,
        metadata=metadata,
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


class _UnaryUnary(aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str | None) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self._token), request)


class _UnaryStream(aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str | None) -> None:
        self._token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_metadata(details, self._token), request)


class _StreamUnary(aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str | None) -> None:
        self._token = token

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_metadata(details, self._token), requests)


class _StreamStream(aio.StreamStreamClientInterceptor):
    def __init__(self, token: str | None) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(_with_metadata(details, self._token), requests)


def channel_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    keepalive_time_seconds: float = 30.0,
    keepalive_timeout_seconds: float = 10.0,
) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_time_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def connect(
    address: str,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Sequence[tuple[str, Any]] = (),
) -> aio.Channel:
    """An async channel to `address` that sends `token` and trace context on every call.

    Call it inside a running event loop (a `grpc.aio` channel binds to the loop it is
    created in); close it with `await channel.close()` or `async with connect(...)`.
    """
    args = channel_options(max_message_bytes) + list(options)
    if tls is not None and tls.server_name:
        args.append(("grpc.ssl_target_name_override", tls.server_name))
    # One object per call kind: aio files each interceptor under the first kind it matches.
    interceptors: Any = [
        _UnaryUnary(token),
        _UnaryStream(token),
        _StreamUnary(token),
        _StreamStream(token),
    ]
    if tls is not None:
        return aio.secure_channel(
            address, tls.credentials(), options=args, interceptors=interceptors
        )
    return aio.insecure_channel(address, options=args, interceptors=interceptors)
