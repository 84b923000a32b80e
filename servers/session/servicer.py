"""`oma.session.v1.SessionService` over the store and the hub: validate the request, call the
core, turn domain errors into status codes with `ErrorInfo` reasons."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import grpc

from oma import __version__
from oma.common.v1 import common_pb2
from oma.runtime.auth import CLIENT, current_role
from oma.runtime.errors import OmaError
from oma.servers.session import errors
from oma.servers.session import events as ev
from oma.servers.session.hub import Hub
from oma.servers.session.store import LeaseGrant, SessionState, SessionStore
from oma.servers.session.streams import stream_events, watch_pending
from oma.session.v1 import definition_pb2, session_service_pb2_grpc
from oma.session.v1 import session_service_pb2 as pb

T = TypeVar("T")

SERVICE_NAME = "oma.session.v1.SessionService"
DEFAULT_TTL_MS = 30_000
FEATURES = ("session.previews", "session.watch_pending", "session.claim")

_CODES: dict[type[errors.SessionError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidPageToken: grpc.StatusCode.INVALID_ARGUMENT,
    errors.MixedBatch: grpc.StatusCode.INVALID_ARGUMENT,
    errors.SessionNotFound: grpc.StatusCode.NOT_FOUND,
    errors.NoSessionPending: grpc.StatusCode.NOT_FOUND,
    errors.SessionTerminated: grpc.StatusCode.FAILED_PRECONDITION,
    errors.LeaseHeld: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SequenceMismatch: grpc.StatusCode.ABORTED,
    errors.LeaseLost: grpc.StatusCode.ABORTED,
    errors.RequestIdReused: grpc.StatusCode.ALREADY_EXISTS,
}


def to_oma_error(error: errors.SessionError) -> OmaError:
    code = _CODES.get(type(error), grpc.StatusCode.INTERNAL)
    return OmaError(code, error.reason, error.message, error.metadata)


async def _call(awaitable: Awaitable[T]) -> T:
    try:
        return await awaitable
    except errors.SessionError as exc:
        raise to_oma_error(exc) from None


def _check_session_id(value: str, field: str = "session_id") -> None:
    if not value:
        raise to_oma_error(
            errors.InvalidArgument("INVALID_FIELD", f"{field} is required", field=field)
        )
    try:
        ev.check_id(value, field)
    except errors.SessionError as exc:
        raise to_oma_error(exc) from None


def session_message(state: SessionState) -> pb.Session:
    session = pb.Session(
        id=state.id,
        definition=definition_pb2.SessionDefinition.FromString(state.definition),
        status=state.status,  # type: ignore[arg-type]
        last_seq=state.last_seq,
        stop_reason=state.stop_reason,  # type: ignore[arg-type]
    )
    session.create_time.FromMicroseconds(state.create_time_us)
    session.update_time.FromMicroseconds(state.update_time_us)
    return session


def lease_message(grant: LeaseGrant) -> pb.Lease:
    lease = pb.Lease(
        session_id=grant.session_id, holder_id=grant.holder_id, fencing_token=grant.fencing_token
    )
    lease.expire_time.FromMicroseconds(grant.expire_us)
    return lease


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def events_response(bodies: list[bytes], next_page_token: str) -> pb.GetEventsResponse:
    # The stored bodies are serialized Events: frame them as field 1 of the response and
    # parse once, instead of parsing each event and copying it into the response.
    wire = b"".join(b"\x0a" + _varint(len(body)) + body for body in bodies)
    response = pb.GetEventsResponse.FromString(wire)
    response.next_page_token = next_page_token
    return response


class SessionServicer(session_service_pb2_grpc.SessionServiceServicer):
    def __init__(self, store: SessionStore, hub: Hub) -> None:
        self.store = store
        self.hub = hub
        self.limits = store.limits

    async def GetCapabilities(
        self, request: pb.GetCapabilitiesRequest, context: Any
    ) -> pb.GetCapabilitiesResponse:
        return pb.GetCapabilitiesResponse(
            server_info=common_pb2.ServerInfo(
                implementation="oma-reference",
                version=__version__,
                api_versions=["oma.session.v1"],
                features=list(FEATURES),
                limits=self.limits.as_capabilities(),
            )
        )

    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: Any
    ) -> pb.CreateSessionResponse:
        try:
            if request.request_id:
                ev.check_id(request.request_id, "request_id")
            if not request.HasField("definition"):
                raise errors.InvalidArgument(
                    "INVALID_FIELD", "definition is required", field="definition"
                )
            ev.check_definition(request.definition)
        except errors.SessionError as exc:
            raise to_oma_error(exc) from None
        state, _ = await _call(self.store.create_session(request.definition, request.request_id))
        return pb.CreateSessionResponse(session=session_message(state))

    async def GetSession(
        self, request: pb.GetSessionRequest, context: Any
    ) -> pb.GetSessionResponse:
        _check_session_id(request.session_id)
        state = await _call(self.store.get_session(request.session_id))
        return pb.GetSessionResponse(session=session_message(state))

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Any
    ) -> pb.ListSessionsResponse:
        states, token = await _call(
            self.store.list_sessions(request.page_size, request.page_token, dict(request.labels))
        )
        return pb.ListSessionsResponse(
            sessions=[session_message(s) for s in states], next_page_token=token
        )

    async def AppendEvents(
        self, request: pb.AppendEventsRequest, context: Any
    ) -> pb.AppendEventsResponse:
        _check_session_id(request.session_id)
        try:
            batch = ev.prepare_batch(
                request.events,
                may_write_harness_events=current_role() != CLIENT,
                limits=self.limits,
            )
        except errors.SessionError as exc:
            raise to_oma_error(exc) from None
        result = await _call(
            self.store.append(
                request.session_id,
                batch,
                expected_last_seq=(
                    request.expected_last_seq if request.HasField("expected_last_seq") else None
                ),
                fencing_token=request.fencing_token,
            )
        )
        return pb.AppendEventsResponse(
            seqs=result.seqs, last_seq=result.last_seq, replayed=result.replayed
        )

    async def GetEvents(self, request: pb.GetEventsRequest, context: Any) -> pb.GetEventsResponse:
        _check_session_id(request.session_id)
        if request.after_seq < 0 or request.before_seq < 0:
            raise to_oma_error(
                errors.InvalidArgument(
                    "INVALID_FIELD", "after_seq and before_seq must be >= 0", field="after_seq"
                )
            )
        unknown = [t for t in request.types if t not in ev.ALL_TYPES]
        if unknown:
            raise to_oma_error(
                errors.InvalidArgument(
                    "INVALID_FIELD",
                    f"types holds unknown event types {unknown[:3]}; known: "
                    f"{', '.join(sorted(ev.ALL_TYPES))}",
                    field="types",
                )
            )
        bodies, token = await _call(
            self.store.get_events_page(
                request.session_id,
                after_seq=request.after_seq,
                before_seq=request.before_seq,
                page_size=request.page_size,
                descending=request.order == pb.EVENT_ORDER_DESCENDING,
                types=list(request.types),
                page_token=request.page_token,
            )
        )
        return events_response(bodies, token)

    async def StreamEvents(
        self, request: pb.StreamEventsRequest, context: Any
    ) -> AsyncIterator[pb.StreamEventsResponse]:
        _check_session_id(request.session_id)
        try:
            async for item in stream_events(
                self.store, self.hub, request.session_id, request.after_seq, request.follow
            ):
                yield item
        except errors.SessionError as exc:
            raise to_oma_error(exc) from None

    def _ttl_ms(self, request: Any) -> int:
        if not request.HasField("ttl"):
            return DEFAULT_TTL_MS
        ms = request.ttl.ToMilliseconds()
        if ms == 0:
            return DEFAULT_TTL_MS
        if ms < 0 or ms > self.limits.max_lease_ttl_ms:
            raise to_oma_error(
                errors.InvalidArgument(
                    "INVALID_FIELD",
                    f"ttl must be between 1 ms and session.max_lease_ttl_ms "
                    f"({self.limits.max_lease_ttl_ms} ms), got {ms} ms",
                    field="ttl",
                )
            )
        return ms

    async def AcquireLease(
        self, request: pb.AcquireLeaseRequest, context: Any
    ) -> pb.AcquireLeaseResponse:
        try:
            ev.check_id(request.holder_id, "holder_id")
            if request.session_id:
                ev.check_id(request.session_id, "session_id")
        except errors.SessionError as exc:
            raise to_oma_error(exc) from None
        ttl = self._ttl_ms(request)
        if request.session_id:
            grant = await _call(
                self.store.acquire_lease(request.session_id, request.holder_id, ttl)
            )
        else:
            grant = await _call(self.store.claim_lease(request.holder_id, ttl))
        return pb.AcquireLeaseResponse(lease=lease_message(grant))

    async def RenewLease(
        self, request: pb.RenewLeaseRequest, context: Any
    ) -> pb.RenewLeaseResponse:
        _check_session_id(request.session_id)
        ttl = self._ttl_ms(request)
        grant = await _call(self.store.renew_lease(request.session_id, request.fencing_token, ttl))
        return pb.RenewLeaseResponse(lease=lease_message(grant))

    async def ReleaseLease(
        self, request: pb.ReleaseLeaseRequest, context: Any
    ) -> pb.ReleaseLeaseResponse:
        _check_session_id(request.session_id)
        await _call(self.store.release_lease(request.session_id, request.fencing_token))
        return pb.ReleaseLeaseResponse()

    async def PublishPreview(
        self, request: pb.PublishPreviewRequest, context: Any
    ) -> pb.PublishPreviewResponse:
        _check_session_id(request.session_id)
        preview = pb.Preview()
        preview.CopyFrom(request.preview)
        preview.session_id = request.session_id
        size = len(preview.text_delta.encode())
        if size > self.limits.max_preview_bytes:
            raise to_oma_error(
                errors.InvalidArgument(
                    "INVALID_FIELD",
                    f"preview.text_delta is {size} bytes; the limit "
                    f"(session.max_preview_bytes) is {self.limits.max_preview_bytes}: split it",
                    field="preview.text_delta",
                    limit=str(self.limits.max_preview_bytes),
                )
            )
        await _call(self.store.check_lease(request.session_id, request.fencing_token))
        self.hub.publish_preview(preview)
        await self.store.notify_preview(preview)
        return pb.PublishPreviewResponse()

    async def WatchPendingSessions(
        self, request: pb.WatchPendingSessionsRequest, context: Any
    ) -> AsyncIterator[pb.WatchPendingSessionsResponse]:
        async for item in watch_pending(self.store, self.hub):
            yield item
