"""Errors that travel as a gRPC status plus a `google.rpc.ErrorInfo` detail.

A servicer raises `OmaError(code, reason, message, metadata)` anywhere in a handler (unary or
streaming); the runtime ends the call with that status code and puts a `google.rpc.Status`
holding one `google.rpc.ErrorInfo` (domain `oma.dev`) in the `grpc-status-details-bin`
trailer, as [COMMON-ERR-001] requires. Clients decode it with `error_info(rpc_error)` and
branch on `reason`, never on the message text.

`reason` is an `oma.common.v1.ErrorReason` name without its `ERROR_REASON_` prefix
(`"LEASE_LOST"`); an unknown reason is rejected when the error is built, so a typo fails
where it is written, not in a client far away.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from oma.common.v1 import common_pb2

DOMAIN = "oma.dev"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
_REASON_PREFIX = "ERROR_REASON_"


def known_reasons() -> frozenset[str]:
    """Every reason string defined by `oma.common.v1.ErrorReason` (prefix stripped)."""
    return frozenset(
        name.removeprefix(_REASON_PREFIX)
        for name in common_pb2.ErrorReason.keys()
        if name != "ERROR_REASON_UNSPECIFIED"
    )


_KNOWN_REASONS = known_reasons()


class OmaError(Exception):
    """A deliberate failure of an RPC: a status code, a stable reason and a human message.

    `metadata` carries the machine-readable facts the reason's contract promises (for
    example `{"last_seq": "41"}` with `SEQUENCE_MISMATCH`); values are strings, as in
    `ErrorInfo.metadata`.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: str,
        message: str,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if reason not in _KNOWN_REASONS:
            raise ValueError(
                f"unknown error reason {reason!r}: add ERROR_REASON_{reason} to "
                "oma.common.v1.ErrorReason first"
            )
        if code is grpc.StatusCode.OK:
            raise ValueError("an OmaError cannot carry status OK")
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in (metadata or {}).items()}

    def __repr__(self) -> str:
        return f"OmaError({self.code.name}, {self.reason!r}, {self.message!r}, {self.metadata!r})"

    def to_status(self) -> status_pb2.Status:
        """The `google.rpc.Status` this error travels as."""
        return rich_status(self.code, self.reason, self.message, self.metadata)

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        """Trailers to end a call with (for `context.abort(..., trailing_metadata=...)`)."""
        return ((STATUS_DETAILS_KEY, self.to_status().SerializeToString()),)


def invalid_field(field: str, problem: str = "is required") -> OmaError:
    """`INVALID_ARGUMENT` / `INVALID_FIELD` naming the request field (`metadata["field"]`),
    the error every contract gives for a missing or malformed field."""
    return OmaError(
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD", f"{field} {problem}", {"field": field}
    )


def require_field(value: str, field: str) -> str:
    """`value`, or `invalid_field(field)` raised when it is empty."""
    if not value:
        raise invalid_field(field)
    return value


def rich_status(
    code: grpc.StatusCode, reason: str, message: str, metadata: Mapping[str, str] | None = None
) -> status_pb2.Status:
    """A `google.rpc.Status` with one `ErrorInfo` detail in the `oma.dev` domain."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=dict(metadata or {}))
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=code.value[0], message=message, details=[detail])


def _trailers_of(rpc_error: Any) -> Iterable[tuple[str, Any]]:
    trailing = getattr(rpc_error, "trailing_metadata", None)
    if trailing is None:
        return ()
    try:
        pairs = trailing()
    except Exception:
        return ()
    return tuple(pairs or ())


def status_of(rpc_error: Any) -> status_pb2.Status | None:
    """The `google.rpc.Status` carried by a failed call (sync or `grpc.aio`), if any."""
    for key, value in _trailers_of(rpc_error):
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status()
            try:
                status.ParseFromString(bytes(value))
            except Exception:
                return None
            return status
    return None


def error_info(rpc_error: Any) -> error_details_pb2.ErrorInfo | None:
    """The `ErrorInfo` of a failed call (a `grpc.RpcError` / `grpc.aio.AioRpcError`).

    Returns None when the call carried no rich status or no `ErrorInfo` detail (for example
    a transport failure, or a server that is not OMA-compliant).
    """
    status = status_of(rpc_error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def reason_of(rpc_error: Any) -> str | None:
    """Shortcut: the `ErrorInfo.reason` of a failed call, or None."""
    info = error_info(rpc_error)
    return info.reason if info is not None else None


def shutting_down_error() -> OmaError:
    """The error open streams end with when their server shuts down ([COMMON-SHUTDOWN-001])."""
    return OmaError(
        grpc.StatusCode.UNAVAILABLE,
        "SERVER_SHUTTING_DOWN",
        "the server is shutting down; reconnect (to another replica or after restart) and "
        "resume from the last position you received",
    )
