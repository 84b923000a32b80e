"""The vault's domain core: credentials, session tokens, proxying, clones, audit, keys.

`Vault` knows nothing of gRPC. Every method either returns domain values or raises
`VaultError` with a stable reason; the servicer maps those to status codes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import hashlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from oma.servers.vault import gitclone, oauth
from oma.servers.vault.crypto import Keyring
from oma.servers.vault.errors import VaultError, invalid_field
from oma.servers.vault.models import (
    AllowedHost,
    AuditEntry,
    CredentialInfo,
    CredentialKind,
    Grant,
    HttpRequestSpec,
    HttpResponseData,
    IssuedToken,
    Secret,
)
from oma.servers.vault.scrub import Scrubber
from oma.servers.vault.store import CredentialRecord, DuplicateCredential, VaultStore
from oma.servers.vault.upstream import (
    Target,
    Upstream,
    check_allowed,
    normalize_host,
    parse_target,
    response_headers,
)

CREDENTIAL_ID = re.compile(r"^[a-z0-9._-]{1,63}$")
REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
HTTP_METHOD = re.compile(r"^[A-Z]{1,16}$")
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$")
FORBIDDEN_SECRET_HEADERS = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "accept-encoding",
    "te",
    "upgrade",
    "keep-alive",
    "trailer",
}
MIN_SECRET_BYTES = 8
TOKEN_PREFIX = "omavst"
STREAM_CHUNK_BYTES = 64 * 1024

# Looks up the vault credential ids a session's definition lists (None: no such session).
SessionCredentials = Callable[[str], Awaitable[set[str] | None]]


@dataclass(frozen=True)
class VaultLimits:
    """Limits in force; GetCapabilities reports them under `vault.*` names."""

    max_request_bytes: int = 4 * 1024 * 1024
    max_response_bytes: int = 8 * 1024 * 1024
    max_stream_bytes: int = 1024 * 1024 * 1024
    max_clone_bytes: int = 512 * 1024 * 1024
    default_timeout_seconds: float = 30.0
    max_timeout_seconds: float = 300.0
    default_token_ttl_seconds: int = 24 * 3600
    max_token_ttl_seconds: int = 7 * 24 * 3600
    clone_timeout_seconds: float = 600.0


@dataclass(frozen=True)
class StreamHead:
    status_code: int
    headers: list[tuple[str, str]]


@dataclass(frozen=True)
class CloneHead:
    commit: str
    ref: str


@dataclass
class _Audit:
    action: str
    actor: str = "session-token:unknown"
    session_id: str = ""
    credential_id: str = ""
    host: str = ""
    method: str = ""
    http_status: int = 0
    outcome: str = "OK"


@dataclass
class _Use:
    """A checked use of a credential: who, what, where."""

    grant: Grant
    record: CredentialRecord
    secret: Secret
    target: Target
    extra_secrets: list[str] = field(default_factory=list)

    def scrubber(self) -> Scrubber:
        return Scrubber([*self.secret.secret_values(), *self.extra_secrets])


def _hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _validate_hosts(hosts: Sequence[AllowedHost]) -> tuple[AllowedHost, ...]:
    if not hosts:
        raise invalid_field("allowed_hosts", "allowed_hosts must name at least one host")
    result: list[AllowedHost] = []
    for i, host in enumerate(hosts):
        name = normalize_host(host.host)
        if not name or any(c in name for c in "/@?#* ") or name.startswith("."):
            raise invalid_field(
                f"allowed_hosts[{i}].host",
                f"allowed_hosts[{i}].host {host.host!r} must be an exact host name or IP literal",
            )
        if not 0 <= host.port <= 65535:
            raise invalid_field(f"allowed_hosts[{i}].port", "port must be 0 (any) or 1-65535")
        result.append(AllowedHost(name, host.port))
    return tuple(dict.fromkeys(result))


def _validate_secret(secret: Secret) -> None:
    required: dict[CredentialKind, list[tuple[str, str]]] = {
        CredentialKind.BEARER: [("secret.bearer.token", secret.token)],
        CredentialKind.HEADER: [("secret.header.value", secret.value)],
        CredentialKind.BASIC: [("secret.basic.password", secret.password)],
        CredentialKind.GIT_TOKEN: [("secret.git_token.token", secret.token)],
        CredentialKind.OAUTH: [],
    }
    for name, value in required[secret.kind]:
        if len(value.encode()) < MIN_SECRET_BYTES:
            raise invalid_field(name, f"{name} must be at least {MIN_SECRET_BYTES} bytes")
    for name, value in [
        ("secret.oauth.access_token", secret.access_token),
        ("secret.oauth.refresh_token", secret.refresh_token),
        ("secret.oauth.client_secret", secret.client_secret),
    ]:
        if value and len(value.encode()) < MIN_SECRET_BYTES:
            raise invalid_field(name, f"{name} must be empty or at least {MIN_SECRET_BYTES} bytes")
    if secret.kind is CredentialKind.HEADER:
        if not HEADER_NAME.match(secret.header_name) or (
            secret.header_name.lower() in FORBIDDEN_SECRET_HEADERS
        ):
            raise invalid_field(
                "secret.header.header_name",
                f"header name {secret.header_name!r} must be an HTTP token and not one the "
                "vault sets itself (Host, Content-Length, hop-by-hop headers)",
            )
    if any("\r" in v or "\n" in v for v in [*secret.secret_values(), secret.username]):
        raise invalid_field("secret", "secret values must not contain line breaks")
    if secret.kind is CredentialKind.OAUTH:
        if not secret.access_token and not secret.refresh_token:
            raise invalid_field("secret.oauth", "an OAuth secret needs an access or refresh token")
        if secret.refresh_token:
            parse_target(secret.token_endpoint, "secret.oauth.token_endpoint")


def _info_for(
    credential_id: str,
    secret: Secret,
    description: str,
    hosts: tuple[AllowedHost, ...],
    version: int,
    created: float,
) -> CredentialInfo:
    return CredentialInfo(
        credential_id=credential_id,
        kind=secret.kind,
        description=description,
        allowed_hosts=hosts,
        version=version,
        header_name=secret.header_name if secret.kind is CredentialKind.HEADER else "",
        username=secret.username
        if secret.kind in (CredentialKind.BASIC, CredentialKind.GIT_TOKEN)
        else "",
        token_endpoint=secret.token_endpoint if secret.kind is CredentialKind.OAUTH else "",
        client_id=secret.client_id if secret.kind is CredentialKind.OAUTH else "",
        access_token_expires_at=secret.access_token_expires_at
        if secret.kind is CredentialKind.OAUTH
        else None,
        created_at=created,
        updated_at=time.time(),
    )


class Vault:
    """Credentials encrypted under `keyring`, persisted in `store`, used through `upstream`."""

    def __init__(
        self,
        store: VaultStore,
        keyring: Keyring,
        limits: VaultLimits | None = None,
        upstream: Upstream | None = None,
    ) -> None:
        self.store = store
        self.keyring = keyring
        self.limits = limits or VaultLimits()
        self.upstream = upstream or Upstream()
        self._refresh_locks: dict[str, asyncio.Lock] = {}
        self._rotation_lock = asyncio.Lock()

    async def close(self) -> None:
        await self.upstream.close()
        await self.store.close()

    # Page tokens ------------------------------------------------------------------------

    def _page_token(self, payload: dict[str, object]) -> str:
        data = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
        return base64.urlsafe_b64encode(self.keyring.mac(data) + data).decode().rstrip("=")

    def _read_page_token(self, token: str, kind: str) -> dict[str, object]:
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            tag, data = raw[:16], raw[16:]
            if len(tag) != 16 or not self.keyring.verify_mac(data, tag):
                raise ValueError
            payload = json.loads(data)
            if not isinstance(payload, dict) or payload.get("k") != kind:
                raise ValueError
            return payload
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raise VaultError(
                "INVALID_PAGE_TOKEN",
                "page_token was not issued by this vault for this listing; start again with "
                "an empty page_token",
            ) from None

    # Credentials ------------------------------------------------------------------------

    def _request_hash(
        self, credential_id: str, description: str, hosts: tuple[AllowedHost, ...], secret: Secret
    ) -> str:
        # A MAC rather than a plain hash: a hash of a weak password in the database would
        # let it be guessed offline.
        canonical = json.dumps(
            [credential_id, description, [str(h) for h in hosts], secret.to_json().decode()]
        ).encode()
        return self.keyring.mac(canonical).hex()

    async def create_credential(
        self,
        *,
        actor: str,
        secret: Secret,
        allowed_hosts: Sequence[AllowedHost],
        credential_id: str = "",
        description: str = "",
        request_id: str = "",
    ) -> CredentialInfo:
        if credential_id and not CREDENTIAL_ID.match(credential_id):
            raise invalid_field(
                "credential_id", "credential_id must be 1-63 characters of [a-z0-9._-]"
            )
        if request_id and not REQUEST_ID.match(request_id):
            raise invalid_field(
                "request_id", "request_id must be 1-128 characters of [A-Za-z0-9._-]"
            )
        hosts = _validate_hosts(allowed_hosts)
        _validate_secret(secret)
        request_hash = self._request_hash(credential_id, description, hosts, secret)
        if request_id:
            existing = await self.store.find_by_request_id(request_id)
            if existing is not None:
                return self._replayed(existing, request_hash, request_id)
        chosen = credential_id or "cred_" + secrets.token_hex(10)
        info = _info_for(chosen, secret, description, hosts, 1, time.time())
        sealed = self.keyring.seal(secret.to_json(), chosen, 1)
        try:
            await self.store.insert_credential(info, sealed, request_id or None, request_hash)
        except DuplicateCredential:
            if request_id:
                existing = await self.store.find_by_request_id(request_id)
                if existing is not None:
                    return self._replayed(existing, request_hash, request_id)
            raise VaultError(
                "CREDENTIAL_EXISTS",
                f"a credential with id {chosen!r} already exists; rotate it or pick another id",
                {"credential_id": chosen},
            ) from None
        await self.store.add_audit(actor=actor, action="create", outcome="OK", credential_id=chosen)
        return info

    def _replayed(
        self, existing: CredentialRecord, request_hash: str, request_id: str
    ) -> CredentialInfo:
        if existing.request_hash != request_hash:
            raise VaultError(
                "REQUEST_ID_REUSED",
                f"request_id {request_id!r} was already used for a different CreateCredential",
                {"request_id": request_id},
            )
        return existing.info

    async def _record(self, credential_id: str) -> CredentialRecord:
        record = await self.store.get_credential(credential_id)
        if record is None:
            raise VaultError(
                "CREDENTIAL_NOT_FOUND",
                f"no credential has id {credential_id!r}",
                {"credential_id": credential_id},
            )
        return record

    def _open(self, record: CredentialRecord) -> Secret:
        return Secret.from_json(
            self.keyring.open(record.sealed, record.info.credential_id, record.info.version)
        )

    async def rotate_credential(
        self, *, actor: str, credential_id: str, secret: Secret
    ) -> CredentialInfo:
        while True:
            record = await self._record(credential_id)
            if secret.kind is not record.info.kind:
                raise VaultError(
                    "CREDENTIAL_KIND_MISMATCH",
                    f"credential {credential_id!r} is of kind {record.info.kind.name}; the new "
                    f"secret is {secret.kind.name}. Delete and re-create it to change its kind",
                )
            new_secret = secret
            if secret.kind is CredentialKind.OAUTH:
                old = self._open(record)
                new_secret = dataclasses.replace(
                    secret,
                    refresh_token=secret.refresh_token or old.refresh_token,
                    token_endpoint=secret.token_endpoint or old.token_endpoint,
                    client_id=secret.client_id or old.client_id,
                    client_secret=secret.client_secret or old.client_secret,
                    scopes=secret.scopes or old.scopes,
                )
            _validate_secret(new_secret)
            version = record.info.version + 1
            info = _info_for(
                credential_id,
                new_secret,
                record.info.description,
                record.info.allowed_hosts,
                version,
                record.info.created_at,
            )
            sealed = self.keyring.seal(new_secret.to_json(), credential_id, version)
            if await self.store.replace_secret(info, sealed, expected_version=record.info.version):
                await self.store.add_audit(
                    actor=actor, action="rotate", outcome="OK", credential_id=credential_id
                )
                return info

    async def delete_credential(self, *, actor: str, credential_id: str) -> None:
        if not await self.store.delete_credential(credential_id):
            raise VaultError(
                "CREDENTIAL_NOT_FOUND",
                f"no credential has id {credential_id!r}",
                {"credential_id": credential_id},
            )
        await self.store.add_audit(
            actor=actor, action="delete", outcome="OK", credential_id=credential_id
        )

    async def list_credentials(
        self, page_size: int, page_token: str
    ) -> tuple[list[CredentialInfo], str]:
        size = 100 if page_size <= 0 else min(page_size, 1000)
        after = ""
        if page_token:
            after = str(self._read_page_token(page_token, "credentials").get("a", ""))
        records = await self.store.list_credentials(after, size + 1)
        infos = [r.info for r in records[:size]]
        next_token = ""
        if len(records) > size:
            next_token = self._page_token({"k": "credentials", "a": infos[-1].credential_id})
        return infos, next_token

    # Session tokens ---------------------------------------------------------------------

    async def issue_token(
        self,
        *,
        actor: str,
        session_id: str,
        credential_ids: Sequence[str],
        ttl_seconds: float,
        session_lookup: SessionCredentials | None = None,
    ) -> IssuedToken:
        """With `session_lookup` (harness callers), every credential must be listed in the
        session's definition."""
        if not session_id:
            raise invalid_field("session_id", "session_id is required")
        if len(session_id) > 256:
            raise invalid_field("session_id", "session_id must be at most 256 characters")
        if not credential_ids:
            raise invalid_field(
                "credential_ids", "credential_ids must name at least one credential"
            )
        wanted = list(dict.fromkeys(credential_ids))
        existing = await self.store.existing_ids(wanted)
        missing = [c for c in wanted if c not in existing]
        if missing:
            raise VaultError(
                "CREDENTIAL_NOT_FOUND",
                f"no credential has id {missing[0]!r}",
                {"credential_id": missing[0]},
            )
        if session_lookup is not None:
            await self._check_session_lists(session_lookup, session_id, wanted)
        ttl = ttl_seconds if ttl_seconds > 0 else self.limits.default_token_ttl_seconds
        ttl = min(ttl, self.limits.max_token_ttl_seconds)
        token_id = secrets.token_hex(8)
        token = f"{TOKEN_PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"
        expires_at = time.time() + ttl
        await self.store.insert_token(token_id, _hash_token(token), session_id, wanted, expires_at)
        await self.store.add_audit(
            actor=actor,
            action="issue_token",
            outcome="OK",
            session_id=session_id,
            credential_id=",".join(wanted)[:63],
        )
        return IssuedToken(token, token_id, expires_at)

    async def _check_session_lists(
        self, lookup: SessionCredentials, session_id: str, wanted: list[str]
    ) -> None:
        listed = await lookup(session_id)
        if listed is None:
            raise VaultError(
                "SESSION_NOT_FOUND", f"no session has id {session_id!r}", {"session_id": session_id}
            )
        for credential_id in wanted:
            if credential_id not in listed:
                raise VaultError(
                    "CREDENTIAL_NOT_GRANTED",
                    f"session {session_id!r} does not list credential {credential_id!r} in its "
                    "definition",
                    {"credential_id": credential_id},
                )

    async def revoke_tokens(self, *, actor: str, session_id: str) -> int:
        if not session_id:
            raise invalid_field("session_id", "session_id is required")
        count = await self.store.revoke_session(session_id)
        await self.store.add_audit(
            actor=actor, action="revoke_tokens", outcome="OK", session_id=session_id
        )
        return count

    async def _grant(self, token: str, credential_id: str, audit: _Audit) -> Grant:
        grant = await self.store.live_grant(_hash_token(token)) if token else None
        if grant is None:
            raise VaultError(
                "SESSION_TOKEN_INVALID",
                "the session token is unknown, expired or revoked; ask for a new one",
            )
        audit.actor = f"session-token:{grant.token_id}"
        audit.session_id = grant.session_id
        if credential_id not in grant.credential_ids:
            raise VaultError(
                "CREDENTIAL_NOT_GRANTED",
                f"the session token of session {grant.session_id!r} does not grant credential "
                f"{credential_id!r}",
                {"credential_id": credential_id},
            )
        return grant

    # Using a credential -----------------------------------------------------------------

    async def _use(
        self, token: str, credential_id: str, url: str, url_field: str, audit: _Audit
    ) -> _Use:
        audit.credential_id = credential_id[:63]
        grant = await self._grant(token, credential_id, audit)
        record = await self._record(credential_id)
        target = parse_target(url, url_field)
        audit.host = target.display
        check_allowed(target, record.info.allowed_hosts, credential_id)
        secret = self._open(record)
        use = _Use(grant, record, secret, target)
        if secret.kind is CredentialKind.OAUTH and oauth.needs_refresh(secret):
            await self._refresh(use, force=False)
        return use

    async def _refresh(self, use: _Use, *, force: bool) -> None:
        """Refresh an OAuth credential (once across concurrent callers) and update `use`."""
        credential_id = use.record.info.credential_id
        lock = self._refresh_locks.setdefault(credential_id, asyncio.Lock())
        async with lock:
            record = await self._record(credential_id)
            current = self._open(record)
            stale = current.access_token == use.secret.access_token
            if not oauth.needs_refresh(current) and not (force and stale):
                use.extra_secrets += use.secret.secret_values()
                use.record, use.secret = record, current
                return
            outcome = "OK"
            try:
                fresh = await oauth.refresh(
                    self.upstream.client,
                    current,
                    credential_id,
                    self.limits.default_timeout_seconds,
                )
            except VaultError as exc:
                outcome = exc.reason
                raise
            finally:
                await self.store.add_audit(
                    actor=f"session-token:{use.grant.token_id}",
                    action="oauth_refresh",
                    outcome=outcome,
                    session_id=use.grant.session_id,
                    credential_id=credential_id,
                    host=parse_target(current.token_endpoint, "token_endpoint").display,
                    method="POST",
                )
            record = await self._store_refreshed(record, fresh)
            use.extra_secrets += current.secret_values()
            use.record, use.secret = record, fresh

    async def _store_refreshed(self, record: CredentialRecord, fresh: Secret) -> CredentialRecord:
        """Persist refreshed tokens. Providers that rotate refresh tokens invalidate the old
        one, so losing this write would break the credential: a row that was merely
        re-encrypted meanwhile (master-key rotation) is retried; only a newer version (an
        admin rotation) wins over the refresh."""
        while True:
            info = dataclasses.replace(
                record.info,
                access_token_expires_at=fresh.access_token_expires_at,
                updated_at=time.time(),
            )
            sealed = self.keyring.seal(fresh.to_json(), info.credential_id, info.version)
            if await self.store.replace_secret(info, sealed, expected=record.sealed):
                return CredentialRecord(info, sealed, record.request_id, record.request_hash)
            latest = await self.store.get_credential(info.credential_id)
            if latest is None or latest.info.version != record.info.version:
                return latest or record
            record = latest

    def _timeout(self, seconds: float) -> float:
        if seconds <= 0:
            return self.limits.default_timeout_seconds
        return min(seconds, self.limits.max_timeout_seconds)

    def _check_request(self, request: HttpRequestSpec) -> None:
        if not HTTP_METHOD.match(request.method or "GET"):
            raise invalid_field("request.method", "request.method must be an HTTP method token")
        for i, (name, value) in enumerate(request.headers):
            if not HEADER_NAME.match(name):
                raise invalid_field(
                    f"request.headers[{i}].name", f"header name {name[:40]!r} is not an HTTP token"
                )
            if any(c in value for c in "\r\n\0"):
                raise invalid_field(
                    f"request.headers[{i}].value",
                    f"header {name!r} has a value with control characters",
                )
            try:
                value.encode("latin-1")
            except UnicodeEncodeError:
                raise invalid_field(
                    f"request.headers[{i}].value", f"header {name!r} has a value outside Latin-1"
                ) from None
        self._check_request_size(request)

    def _check_request_size(self, request: HttpRequestSpec) -> None:
        if len(request.body) > self.limits.max_request_bytes:
            raise VaultError(
                "REQUEST_TOO_LARGE",
                f"the request body is {len(request.body)} bytes, above the proxy limit of "
                f"{self.limits.max_request_bytes}",
                {"limit": str(self.limits.max_request_bytes)},
            )

    async def _finish_audit(self, audit: _Audit) -> None:
        await asyncio.shield(
            self.store.add_audit(
                actor=audit.actor,
                action=audit.action,
                outcome=audit.outcome,
                session_id=audit.session_id,
                credential_id=audit.credential_id,
                host=audit.host,
                method=audit.method,
                http_status=audit.http_status,
            )
        )

    def _retry_after_401(self, use: _Use, status: int, attempt: int) -> bool:
        return (
            status == 401
            and attempt == 0
            and use.secret.kind is CredentialKind.OAUTH
            and bool(use.secret.refresh_token)
        )

    async def proxy(
        self,
        *,
        token: str,
        credential_id: str,
        request: HttpRequestSpec,
        timeout_seconds: float = 0,
    ) -> HttpResponseData:
        audit = _Audit(
            "proxy", credential_id=credential_id[:63], method=(request.method or "GET").upper()[:16]
        )
        try:
            self._check_request(request)
            use = await self._use(token, credential_id, request.url, "request.url", audit)
            timeout = self._timeout(timeout_seconds)
            try:
                async with asyncio.timeout(timeout):
                    result = await self._exchange(use, request, timeout)
            except TimeoutError:
                raise VaultError(
                    "UPSTREAM_TIMEOUT",
                    f"{use.target.display} did not answer within {timeout:g}s",
                    {"host": use.target.display},
                ) from None
            audit.http_status = result.status_code
            return result
        except VaultError as exc:
            audit.outcome = exc.reason
            raise
        finally:
            await self._finish_audit(audit)

    async def _exchange(
        self, use: _Use, request: HttpRequestSpec, time_limit: float
    ) -> HttpResponseData:
        limit = self.limits.max_response_bytes
        for attempt in range(2):
            async with self.upstream.open(request, use.secret, use.target, time_limit) as response:
                if self._retry_after_401(use, response.status_code, attempt):
                    retry = True
                else:
                    retry = False
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > limit:
                            raise VaultError(
                                "RESPONSE_TOO_LARGE",
                                f"the response body of {use.target.display} exceeds the proxy "
                                f"limit of {limit} bytes; use ProxyStream for large bodies",
                                {"limit": str(limit)},
                            )
                    scrubber = use.scrubber()
                    headers, count = _scrub_headers(response_headers(response), scrubber)
                    scrubbed, body_count = scrubber.scrub(bytes(body))
                    headers.append(("content-length", str(len(scrubbed))))
                    return HttpResponseData(
                        response.status_code, headers, scrubbed, count + body_count
                    )
            if retry:
                await self._refresh(use, force=True)
        raise AssertionError("unreachable")

    async def proxy_stream(
        self,
        *,
        token: str,
        credential_id: str,
        request: HttpRequestSpec,
        timeout_seconds: float = 0,
    ) -> AsyncIterator[StreamHead | bytes]:
        """Yields one `StreamHead`, then scrubbed body chunks (each at most 64 KiB)."""
        audit = _Audit(
            "proxy_stream",
            credential_id=credential_id[:63],
            method=(request.method or "GET").upper()[:16],
        )
        try:
            self._check_request(request)
            use = await self._use(token, credential_id, request.url, "request.url", audit)
            timeout = self._timeout(timeout_seconds)
            limit = self.limits.max_stream_bytes
            for attempt in range(2):
                async with self.upstream.open(request, use.secret, use.target, timeout) as response:
                    if self._retry_after_401(use, response.status_code, attempt):
                        retry = True
                    else:
                        retry = False
                        scrubber = use.scrubber()
                        headers, _ = _scrub_headers(response_headers(response), scrubber)
                        audit.http_status = response.status_code
                        yield StreamHead(response.status_code, headers)
                        stream = scrubber.stream()
                        total = 0
                        async for chunk in response.aiter_bytes():
                            total += len(chunk)
                            if total > limit:
                                raise VaultError(
                                    "RESPONSE_TOO_LARGE",
                                    f"the streamed body of {use.target.display} exceeds "
                                    f"{limit} bytes",
                                    {"limit": str(limit)},
                                )
                            for piece in _pieces(stream.feed(chunk)):
                                yield piece
                        for piece in _pieces(stream.flush()):
                            yield piece
                        return
                if retry:
                    await self._refresh(use, force=True)
        except VaultError as exc:
            audit.outcome = exc.reason
            raise
        except (asyncio.CancelledError, GeneratorExit):
            audit.outcome = "CANCELLED"
            raise
        finally:
            await self._finish_audit(audit)

    async def clone(
        self, *, token: str, credential_id: str, url: str, ref: str = "", depth: int = 0
    ) -> AsyncIterator[CloneHead | bytes]:
        """Yields one `CloneHead`, then the tar archive of the checkout in chunks."""
        audit = _Audit("clone", method="GIT")
        workdir = None
        try:
            if depth < 0:
                raise invalid_field("depth", "depth must be 0 (full history) or positive")
            if ref.startswith("-"):
                raise invalid_field("ref", "ref must be a branch or tag name")
            use = await self._use(token, credential_id, url, "url", audit)
            cloned, workdir = await gitclone.clone(
                url,
                ref,
                depth,
                use.secret,
                use.scrubber(),
                time_limit=self.limits.clone_timeout_seconds,
                max_bytes=self.limits.max_clone_bytes,
            )
            yield CloneHead(cloned.commit, cloned.ref)
            async for chunk in gitclone.archive_chunks(cloned.archive):
                yield chunk
        except VaultError as exc:
            audit.outcome = exc.reason
            raise
        except (asyncio.CancelledError, GeneratorExit):
            audit.outcome = "CANCELLED"
            raise
        finally:
            if workdir is not None:
                gitclone.remove_workdir(workdir)
            await self._finish_audit(audit)

    # Audit ------------------------------------------------------------------------------

    async def list_audit(
        self, page_size: int, page_token: str, session_id: str = "", credential_id: str = ""
    ) -> tuple[list[AuditEntry], str]:
        size = 100 if page_size <= 0 else min(page_size, 1000)
        before: int | None = None
        if page_token:
            payload = self._read_page_token(page_token, "audit")
            if payload.get("s") != session_id or payload.get("c") != credential_id:
                raise VaultError(
                    "INVALID_PAGE_TOKEN",
                    "page_token belongs to a listing with other filters; start again",
                )
            before = int(payload["b"])  # type: ignore[call-overload]
        entries = await self.store.list_audit(before, size + 1, session_id, credential_id)
        page = entries[:size]
        next_token = ""
        if len(entries) > size:
            next_token = self._page_token(
                {"k": "audit", "b": page[-1].audit_id, "s": session_id, "c": credential_id}
            )
        return page, next_token

    # Master key -------------------------------------------------------------------------

    async def rotate_master_key(self, *, actor: str) -> tuple[str, int]:
        """Re-encrypt every secret under a new master key; serving continues throughout."""
        if self.keyring.external:
            raise VaultError(
                "MASTER_KEY_EXTERNAL",
                "the master key comes from OMA_VAULT_MASTER_KEY; restart the vault with the new "
                "key there and the old one in OMA_VAULT_PREVIOUS_MASTER_KEYS (it re-encrypts "
                "while serving), or run it with a key file to rotate online",
            )
        async with self._rotation_lock:
            new_id = await asyncio.to_thread(self.keyring.begin_rotation)
            count, unreadable = await self._reencrypt_all()
            if not unreadable:
                await asyncio.to_thread(self.keyring.finish_rotation)
            await self.store.add_audit(actor=actor, action="rotate_master_key", outcome="OK")
            return new_id, count

    async def reencrypt_stale(self) -> tuple[int, list[str]]:
        """Finish any rotation: re-encrypt secrets still under a retired key the keyring holds
        (an interrupted rotation, or a restart with OMA_VAULT_PREVIOUS_MASTER_KEYS). Returns
        how many were re-encrypted and the ids of credentials under a key nobody holds."""
        async with self._rotation_lock:
            count, unreadable = await self._reencrypt_all()
            if not unreadable and not self.keyring.external:
                await asyncio.to_thread(self.keyring.finish_rotation)
            return count, unreadable

    async def _reencrypt_all(self) -> tuple[int, list[str]]:
        count = 0
        unreadable: set[str] = set()
        while True:
            stale = [
                r
                for r in await self.store.credentials_not_under(self.keyring.current_id)
                if r.info.credential_id not in unreadable
            ]
            if not stale:
                return count, sorted(unreadable)
            for record in stale:
                credential_id, version = record.info.credential_id, record.info.version
                if not self.keyring.holds(record.sealed.key_id):
                    unreadable.add(credential_id)
                    continue
                plain = self.keyring.open(record.sealed, credential_id, version)
                sealed = self.keyring.seal(plain, credential_id, version)
                # Compare-and-set: a concurrent rotation or refresh already re-sealed the
                # row under the new key, which the next pass confirms.
                if await self.store.replace_secret(record.info, sealed, expected=record.sealed):
                    count += 1


def _scrub_headers(
    headers: list[tuple[str, str]], scrubber: Scrubber
) -> tuple[list[tuple[str, str]], int]:
    out: list[tuple[str, str]] = []
    total = 0
    for name, value in headers:
        clean_name, n1 = scrubber.scrub_text(name)
        clean_value, n2 = scrubber.scrub_text(value)
        out.append((clean_name, clean_value))
        total += n1 + n2
    return out, total


def _pieces(data: bytes) -> list[bytes]:
    return [data[i : i + STREAM_CHUNK_BYTES] for i in range(0, len(data), STREAM_CHUNK_BYTES)]


__all__ = ["CloneHead", "StreamHead", "Vault", "VaultLimits"]
