"""Domain types of the vault: credential kinds, secrets, metadata, grants and audit rows.

Secrets are plain dataclasses that serialise to JSON for encryption; metadata types never
hold a secret value, so anything built from them is safe to return or log.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any


class CredentialKind(IntEnum):
    """Mirrors `oma.vault.v1.CredentialKind` (same numbers)."""

    BEARER = 1
    HEADER = 2
    BASIC = 3
    GIT_TOKEN = 4
    OAUTH = 5


DEFAULT_GIT_USERNAME = "x-access-token"


@dataclass(frozen=True)
class AllowedHost:
    """A host (lower-cased) and a port; port 0 allows every port of the host."""

    host: str
    port: int = 0

    def matches(self, host: str, port: int) -> bool:
        return self.host == host.lower() and (self.port == 0 or self.port == port)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}" if self.port else self.host


@dataclass
class Secret:
    """The secret material of one credential, whatever its kind.

    Non-secret companions (header name, user name, OAuth endpoint and client id) live here
    too so that one encrypted blob describes how to authenticate; they are also copied into
    the credential's metadata.
    """

    kind: CredentialKind
    token: str = ""  # bearer, git token
    header_name: str = ""
    value: str = ""  # custom header value
    username: str = ""
    password: str = ""
    access_token: str = ""
    access_token_expires_at: float | None = None  # epoch seconds
    refresh_token: str = ""
    token_endpoint: str = ""
    client_id: str = ""
    client_secret: str = ""
    scopes: list[str] = field(default_factory=list)

    def secret_values(self) -> list[str]:
        """Every value that must never leave the vault (for scrubbing)."""
        candidates = [
            self.token,
            self.value,
            self.password,
            self.access_token,
            self.refresh_token,
            self.client_secret,
        ]
        return [value for value in candidates if value]

    def to_json(self) -> bytes:
        data = asdict(self)
        data["kind"] = int(self.kind)
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Secret:
        data: dict[str, Any] = json.loads(raw)
        data["kind"] = CredentialKind(data["kind"])
        return cls(**data)


@dataclass(frozen=True)
class CredentialInfo:
    """A credential's metadata: everything but the secret."""

    credential_id: str
    kind: CredentialKind
    description: str
    allowed_hosts: tuple[AllowedHost, ...]
    version: int
    header_name: str
    username: str
    token_endpoint: str
    client_id: str
    access_token_expires_at: float | None
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class Grant:
    """What a valid session token entitles its bearer to."""

    token_id: str
    session_id: str
    credential_ids: frozenset[str]
    expires_at: float


@dataclass(frozen=True)
class IssuedToken:
    token: str
    token_id: str
    expires_at: float


@dataclass(frozen=True)
class AuditEntry:
    """One audit row (never a secret)."""

    audit_id: int
    time: float
    actor: str
    session_id: str
    credential_id: str
    action: str
    host: str
    method: str
    http_status: int
    outcome: str


@dataclass(frozen=True)
class HttpRequestSpec:
    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes


@dataclass(frozen=True)
class HttpResponseData:
    status_code: int
    headers: list[tuple[str, str]]
    body: bytes
    redaction_count: int
