"""Domain errors of the session store. They know nothing of gRPC: the servicer maps each
class to a status code, and `reason` is the `oma.common.v1.ErrorReason` name it travels with."""

from __future__ import annotations


class SessionError(Exception):
    """Base class: a request the store refuses, with a stable reason and a message for people."""

    reason = "INTERNAL"

    def __init__(self, message: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.metadata = dict(metadata or {})


class InvalidArgument(SessionError):
    """A malformed request; `metadata["field"]` names the field when there is one."""

    def __init__(self, reason: str, message: str, field: str | None = None, **extra: str) -> None:
        metadata = {"field": field} if field else {}
        metadata.update(extra)
        super().__init__(message, metadata)
        self.reason = reason


class SessionNotFound(SessionError):
    reason = "SESSION_NOT_FOUND"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no session has id {session_id!r}", {"session_id": session_id})


class SessionTerminated(SessionError):
    reason = "SESSION_TERMINATED"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id} is terminated and accepts no more events or leases",
            {"session_id": session_id},
        )


class SequenceMismatch(SessionError):
    reason = "SEQUENCE_MISMATCH"

    def __init__(self, expected: int, last_seq: int) -> None:
        super().__init__(
            f"expected_last_seq is {expected} but the session's last seq is {last_seq}; "
            "reread the log from there and decide again",
            {"last_seq": str(last_seq)},
        )
        self.last_seq = last_seq


class MixedBatch(SessionError):
    reason = "MIXED_BATCH"

    def __init__(self, known: list[str], new: list[str]) -> None:
        super().__init__(
            f"the batch mixes event ids already in the log ({', '.join(known[:3])}) with new ones "
            f"({', '.join(new[:3])}); retry the exact batch that was sent, or send only new events",
            {"known_ids": ",".join(known[:10])},
        )


class LeaseLost(SessionError):
    reason = "LEASE_LOST"

    def __init__(self, session_id: str, why: str) -> None:
        super().__init__(
            f"session {session_id}: {why}; stop driving the session (acquire the lease again "
            "and reread the log before writing)",
            {"session_id": session_id},
        )


class LeaseHeld(SessionError):
    reason = "LEASE_HELD"

    def __init__(self, session_id: str, holder_id: str, expire_time: str) -> None:
        super().__init__(
            f"session {session_id} is leased by {holder_id!r} until {expire_time}; "
            "wait for the next pending-session push or for the lease to expire",
            {"holder_id": holder_id, "expire_time": expire_time},
        )


class RequestIdReused(SessionError):
    reason = "REQUEST_ID_REUSED"

    def __init__(self, request_id: str, session_id: str) -> None:
        super().__init__(
            f"request_id {request_id!r} already created session {session_id} from a different "
            "definition; use a new request_id for a new session",
            {"session_id": session_id},
        )


class NoSessionPending(SessionError):
    reason = "NO_SESSION_PENDING"

    def __init__(self) -> None:
        super().__init__(
            "no session needs a harness right now; wait for a WatchPendingSessions push"
        )


class InvalidPageToken(SessionError):
    reason = "INVALID_PAGE_TOKEN"

    def __init__(self) -> None:
        super().__init__(
            "page_token was not issued by this server for this query; "
            "repeat the query without it to start over",
            {"field": "page_token"},
        )
