"""Channels to OMA servers: bearer token, W3C trace context, TLS/mTLS, limits, keepalive.

`connect(address, token=..., tls=None)` returns a `grpc.aio.Channel` (an `OmaChannel`) whose every call
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


class _Outgoing:
    """Adds the bearer token and trace context to one call's metadata.

    Runs synchronously when a stub method is called, i.e. in the caller's context, which is
    what makes `trace.current()` (a contextvar) visible here.
    """

    def __init__(self, token: str | None) -> None:
        self._auth = f"Bearer {token}" if token is not None else None

    def __call__(self, metadata: Any) -> tuple[tuple[str, str | bytes], ...]:
        pairs: list[tuple[str, str | bytes]] = list(metadata or ())
        keys = {key for key, _ in pairs}
        # A traceparent or authorization the caller put on this call by hand wins.
        if trace.TRACEPARENT not in keys:
            ctx = trace.outgoing()
            pairs.append((trace.TRACEPARENT, ctx.traceparent))
            if ctx.tracestate and trace.TRACESTATE not in keys:
                pairs.append((trace.TRACESTATE, ctx.tracestate))
        if self._auth is not None and "authorization" not in keys:
            pairs.append(("authorization", self._auth))
        return tuple(pairs)


class _AddsMetadata:
    """The one behaviour every wrapped multi-callable has: call gRPC's own with the bearer
    token and trace context added to the caller's metadata."""

    def __init__(self, inner: Any, outgoing: _Outgoing) -> None:
        self._inner = inner
        self._outgoing = outgoing

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        return self._inner(*args, metadata=self._outgoing(metadata), **kwargs)


# One subclass per call kind, so that each is an instance of the ABC grpc.aio expects.
class _UnaryUnary(_AddsMetadata, aio.UnaryUnaryMultiCallable):
    pass


class _UnaryStream(_AddsMetadata, aio.UnaryStreamMultiCallable):
    pass


class _StreamUnary(_AddsMetadata, aio.StreamUnaryMultiCallable):
    pass


class _StreamStream(_AddsMetadata, aio.StreamStreamMultiCallable):
    pass


class OmaChannel(aio.Channel):
    """A `grpc.aio.Channel` whose calls carry the bearer token and trace context.

    It wraps each multi-callable rather than using client interceptors: the metadata is
    added when the stub is called, and the call objects returned are gRPC's own, at no
    extra per-call task.
    """

    def __init__(self, inner: aio.Channel, token: str | None) -> None:
        self.inner = inner
        self._outgoing = _Outgoing(token)

    async def __aenter__(self) -> OmaChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.inner.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self.inner.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.inner.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self.inner.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.inner.channel_ready()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryUnary(self.inner.unary_unary(method, *args, **kwargs), self._outgoing)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryStream(self.inner.unary_stream(method, *args, **kwargs), self._outgoing)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamUnary(self.inner.stream_unary(method, *args, **kwargs), self._outgoing)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamStream(self.inner.stream_stream(method, *args, **kwargs), self._outgoing)


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
) -> OmaChannel:
    """An async channel to `address` that sends `token` and trace context on every call.

    Call it inside a running event loop (a `grpc.aio` channel binds to the loop it is
    created in); close it with `await channel.close()` or `async with connect(...)`.
    """
    args = channel_options(max_message_bytes) + list(options)
    if tls is not None and tls.server_name:
        args.append(("grpc.ssl_target_name_override", tls.server_name))
    if tls is not None:
        inner = aio.secure_channel(address, tls.credentials(), options=args)
    else:
        inner = aio.insecure_channel(address, options=args)
    return OmaChannel(inner, token)
