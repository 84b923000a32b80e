"""Domain errors of the vault core, each tied to one `oma.common.v1.ErrorReason`.

The core raises `VaultError(reason, message)`; the servicer maps the reason to a gRPC status
code with `STATUS_OF_REASON`, so the core never imports grpc.
"""

from __future__ import annotations

from collections.abc import Mapping


class VaultError(Exception):
    """A deliberate failure: a stable `reason` (ErrorReason name without prefix), a message a
    person can act on, and machine-readable `metadata`."""

    def __init__(self, reason: str, message: str, metadata: Mapping[str, str] | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata = dict(metadata or {})


# Reason → gRPC status code name; the servicer turns the name into `grpc.StatusCode`.
STATUS_OF_REASON: dict[str, str] = {
    "INVALID_FIELD": "INVALID_ARGUMENT",
    "INVALID_PAGE_TOKEN": "INVALID_ARGUMENT",
    "REQUEST_ID_REUSED": "ALREADY_EXISTS",
    "ROLE_FORBIDDEN": "PERMISSION_DENIED",
    "SESSION_NOT_FOUND": "NOT_FOUND",
    "FEATURE_NOT_SUPPORTED": "UNIMPLEMENTED",
    "CREDENTIAL_NOT_FOUND": "NOT_FOUND",
    "HOST_NOT_ALLOWED": "PERMISSION_DENIED",
    "REDIRECT_REFUSED": "PERMISSION_DENIED",
    "SESSION_TOKEN_INVALID": "UNAUTHENTICATED",
    "CREDENTIAL_NOT_GRANTED": "PERMISSION_DENIED",
    "REQUEST_TOO_LARGE": "RESOURCE_EXHAUSTED",
    "RESPONSE_TOO_LARGE": "RESOURCE_EXHAUSTED",
    "UPSTREAM_TIMEOUT": "DEADLINE_EXCEEDED",
    "UPSTREAM_UNREACHABLE": "UNAVAILABLE",
    "REFRESH_FAILED": "FAILED_PRECONDITION",
    "CREDENTIAL_EXISTS": "ALREADY_EXISTS",
    "CREDENTIAL_KIND_MISMATCH": "INVALID_ARGUMENT",
    "CLONE_FAILED": "FAILED_PRECONDITION",
    "MASTER_KEY_EXTERNAL": "FAILED_PRECONDITION",
    "INTERNAL": "INTERNAL",
}


def invalid_field(field: str, message: str) -> VaultError:
    return VaultError("INVALID_FIELD", message, {"field": field})
