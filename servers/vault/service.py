"""The gRPC face of the vault: validates requests, calls `Vault`, maps errors.

Authentication by role is done by the runtime from each method's `(oma.common.v1.auth)`
option; this servicer only adds what the contract asks beyond that (harness callers of
`IssueSessionToken` are checked against the session's definition).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from oma import __version__
from oma.common.v1 import common_pb2
from oma.runtime.auth import ADMIN, HARNESS, current_role
from oma.runtime.errors import OmaError, invalid_field, require_field
from oma.servers.vault.core import CloneHead, StreamHead, Vault
from oma.servers.vault.errors import STATUS_OF_REASON, VaultError
from oma.servers.vault.models import (
    AllowedHost,
    AuditEntry,
    CredentialInfo,
    CredentialKind,
    HttpRequestSpec,
    Secret,
)
from oma.vault.v1 import vault_pb2, vault_pb2_grpc

SERVICE_NAME = "oma.vault.v1.VaultService"
FEATURES = [
    "vault.proxy_stream",
    "vault.clone_repository",
    "vault.oauth_refresh",
    "vault.master_key_rotation",
]

# (session id, caller's bearer token) → credential ids the session lists, None if unknown.
SessionLookupFactory = Callable[[str], Callable[[str], Awaitable[set[str] | None]]]


def _oma_error(exc: VaultError) -> OmaError:
    code = getattr(grpc.StatusCode, STATUS_OF_REASON.get(exc.reason, "INTERNAL"))
    return OmaError(code, exc.reason, exc.message, exc.metadata)


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1_000_000_000))
    return ts


def credential_to_proto(info: CredentialInfo) -> vault_pb2.Credential:
    message = vault_pb2.Credential(
        credential_id=info.credential_id,
        kind=int(info.kind),  # type: ignore[arg-type]
        description=info.description,
        allowed_hosts=[vault_pb2.AllowedHost(host=h.host, port=h.port) for h in info.allowed_hosts],
        version=info.version,
        header_name=info.header_name,
        username=info.username,
        token_endpoint=info.token_endpoint,
        client_id=info.client_id,
    )
    if info.access_token_expires_at is not None:
        message.access_token_expire_time.CopyFrom(_timestamp(info.access_token_expires_at))
    message.create_time.CopyFrom(_timestamp(info.created_at))
    message.update_time.CopyFrom(_timestamp(info.updated_at))
    return message


def secret_from_proto(message: vault_pb2.CredentialSecret) -> Secret:
    which = message.WhichOneof("kind")
    if which == "bearer":
        return Secret(CredentialKind.BEARER, token=message.bearer.token)
    if which == "header":
        return Secret(
            CredentialKind.HEADER,
            header_name=message.header.header_name,
            value=message.header.value,
        )
    if which == "basic":
        return Secret(
            CredentialKind.BASIC, username=message.basic.username, password=message.basic.password
        )
    if which == "git_token":
        return Secret(
            CredentialKind.GIT_TOKEN,
            token=message.git_token.token,
            username=message.git_token.username,
        )
    if which == "oauth":
        o = message.oauth
        expires = (
            o.access_token_expire_time.ToNanoseconds() / 1e9
            if o.HasField("access_token_expire_time")
            else None
        )
        return Secret(
            CredentialKind.OAUTH,
            access_token=o.access_token,
            access_token_expires_at=expires,
            refresh_token=o.refresh_token,
            token_endpoint=o.token_endpoint,
            client_id=o.client_id,
            client_secret=o.client_secret,
            scopes=list(o.scopes),
        )
    raise invalid_field("secret", "must set one of bearer, header, basic, git_token, oauth")


def _http_request(message: vault_pb2.HttpRequest, present: bool) -> HttpRequestSpec:
    if not present or not message.url:
        raise invalid_field("request.url")
    return HttpRequestSpec(
        method=message.method.upper() or "GET",
        url=message.url,
        headers=[(h.name, h.value) for h in message.headers],
        body=message.body,
    )


def _audit_to_proto(entry: AuditEntry) -> vault_pb2.AuditRecord:
    return vault_pb2.AuditRecord(
        audit_id=entry.audit_id,
        time=_timestamp(entry.time),
        actor=entry.actor,
        session_id=entry.session_id,
        credential_id=entry.credential_id,
        action=entry.action,
        host=entry.host,
        method=entry.method,
        http_status=entry.http_status,
        outcome=entry.outcome,
    )


def _bearer(context: Any) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value.removeprefix("Bearer ")
    return ""


class VaultServicer(vault_pb2_grpc.VaultServiceServicer):
    """`oma.vault.v1.VaultService` over a `Vault`."""

    def __init__(self, vault: Vault, session_lookup: SessionLookupFactory | None = None) -> None:
        self.vault = vault
        self.session_lookup = session_lookup

    @staticmethod
    def _actor() -> str:
        return current_role() or "unknown"

    async def GetCapabilities(
        self, request: Any, context: Any
    ) -> vault_pb2.GetCapabilitiesResponse:
        limits = self.vault.limits
        features = list(FEATURES)
        if self.session_lookup is not None:
            features.append("vault.harness_token_issue")
        if self.vault.keyring.external:
            features.remove("vault.master_key_rotation")
        info = common_pb2.ServerInfo(
            implementation="oma-reference",
            version=__version__,
            api_versions=["oma.vault.v1"],
            features=features,
            limits={
                "vault.max_request_bytes": limits.max_request_bytes,
                "vault.max_response_bytes": limits.max_response_bytes,
                "vault.max_stream_bytes": limits.max_stream_bytes,
                "vault.max_clone_bytes": limits.max_clone_bytes,
                "vault.max_timeout_ms": int(limits.max_timeout_seconds * 1000),
                "vault.max_token_ttl_seconds": limits.max_token_ttl_seconds,
            },
        )
        return vault_pb2.GetCapabilitiesResponse(
            server_info=info,
            credential_kinds=[int(k) for k in CredentialKind],  # type: ignore[misc]
        )

    async def CreateCredential(
        self, request: Any, context: Any
    ) -> vault_pb2.CreateCredentialResponse:
        if not request.HasField("secret"):
            raise invalid_field("secret")
        try:
            info = await self.vault.create_credential(
                actor=self._actor(),
                secret=secret_from_proto(request.secret),
                allowed_hosts=[AllowedHost(h.host, h.port) for h in request.allowed_hosts],
                credential_id=request.credential_id,
                description=request.description,
                request_id=request.request_id,
            )
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.CreateCredentialResponse(credential=credential_to_proto(info))

    async def RotateCredential(
        self, request: Any, context: Any
    ) -> vault_pb2.RotateCredentialResponse:
        require_field(request.credential_id, "credential_id")
        if not request.HasField("secret"):
            raise invalid_field("secret")
        try:
            info = await self.vault.rotate_credential(
                actor=self._actor(),
                credential_id=request.credential_id,
                secret=secret_from_proto(request.secret),
            )
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.RotateCredentialResponse(credential=credential_to_proto(info))

    async def DeleteCredential(
        self, request: Any, context: Any
    ) -> vault_pb2.DeleteCredentialResponse:
        require_field(request.credential_id, "credential_id")
        try:
            await self.vault.delete_credential(
                actor=self._actor(), credential_id=request.credential_id
            )
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.DeleteCredentialResponse()

    async def ListCredentials(
        self, request: Any, context: Any
    ) -> vault_pb2.ListCredentialsResponse:
        try:
            infos, token = await self.vault.list_credentials(request.page_size, request.page_token)
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.ListCredentialsResponse(
            credentials=[credential_to_proto(i) for i in infos], next_page_token=token
        )

    async def IssueSessionToken(
        self, request: Any, context: Any
    ) -> vault_pb2.IssueSessionTokenResponse:
        require_field(request.session_id, "session_id")
        lookup = None
        if current_role() != ADMIN:
            if current_role() != HARNESS or self.session_lookup is None:
                raise OmaError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    "ROLE_FORBIDDEN",
                    "this vault cannot check session definitions (started without --session), "
                    "so only an admin may issue session tokens",
                )
            lookup = self.session_lookup(_bearer(context))
        ttl = request.ttl.ToNanoseconds() / 1e9 if request.HasField("ttl") else 0.0
        try:
            issued = await self.vault.issue_token(
                actor=self._actor(),
                session_id=request.session_id,
                credential_ids=list(request.credential_ids),
                ttl_seconds=ttl,
                session_lookup=lookup,
            )
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.IssueSessionTokenResponse(
            session_token=issued.token,
            token_id=issued.token_id,
            expire_time=_timestamp(issued.expires_at),
        )

    async def RevokeSessionTokens(
        self, request: Any, context: Any
    ) -> vault_pb2.RevokeSessionTokensResponse:
        require_field(request.session_id, "session_id")
        try:
            count = await self.vault.revoke_tokens(
                actor=self._actor(), session_id=request.session_id
            )
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.RevokeSessionTokensResponse(revoked_count=count)

    async def Proxy(self, request: Any, context: Any) -> vault_pb2.ProxyResponse:
        spec = _http_request(request.request, request.HasField("request"))
        require_field(request.credential_id, "credential_id")
        timeout = request.timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else 0.0
        try:
            result = await self.vault.proxy(
                token=request.session_token,
                credential_id=request.credential_id,
                request=spec,
                timeout_seconds=timeout,
            )
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.ProxyResponse(
            status_code=result.status_code,
            headers=[vault_pb2.HttpHeader(name=k, value=v) for k, v in result.headers],
            body=result.body,
            redaction_count=result.redaction_count,
        )

    async def ProxyStream(
        self, request: Any, context: Any
    ) -> AsyncIterator[vault_pb2.ProxyStreamResponse]:
        spec = _http_request(request.request, request.HasField("request"))
        require_field(request.credential_id, "credential_id")
        timeout = request.timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else 0.0
        parts = self.vault.proxy_stream(
            token=request.session_token,
            credential_id=request.credential_id,
            request=spec,
            timeout_seconds=timeout,
        )
        try:
            async for part in parts:
                if isinstance(part, StreamHead):
                    yield vault_pb2.ProxyStreamResponse(
                        head=vault_pb2.ResponseHead(
                            status_code=part.status_code,
                            headers=[
                                vault_pb2.HttpHeader(name=k, value=v) for k, v in part.headers
                            ],
                        )
                    )
                elif part:
                    yield vault_pb2.ProxyStreamResponse(body_chunk=part)
        except VaultError as exc:
            raise _oma_error(exc) from None
        finally:
            await parts.aclose()  # type: ignore[attr-defined]

    async def ListAudit(self, request: Any, context: Any) -> vault_pb2.ListAuditResponse:
        try:
            entries, token = await self.vault.list_audit(
                request.page_size, request.page_token, request.session_id, request.credential_id
            )
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.ListAuditResponse(
            records=[_audit_to_proto(e) for e in entries], next_page_token=token
        )

    async def CloneRepository(
        self, request: Any, context: Any
    ) -> AsyncIterator[vault_pb2.CloneRepositoryResponse]:
        require_field(request.credential_id, "credential_id")
        require_field(request.url, "url")
        parts = self.vault.clone(
            token=request.session_token,
            credential_id=request.credential_id,
            url=request.url,
            ref=request.ref,
            depth=request.depth,
        )
        try:
            async for part in parts:
                if isinstance(part, CloneHead):
                    yield vault_pb2.CloneRepositoryResponse(
                        info=vault_pb2.CloneInfo(commit=part.commit, ref=part.ref)
                    )
                elif part:
                    yield vault_pb2.CloneRepositoryResponse(tar_chunk=part)
        except VaultError as exc:
            raise _oma_error(exc) from None
        finally:
            await parts.aclose()  # type: ignore[attr-defined]

    async def RotateMasterKey(
        self, request: Any, context: Any
    ) -> vault_pb2.RotateMasterKeyResponse:
        try:
            key_id, count = await self.vault.rotate_master_key(actor=self._actor())
        except VaultError as exc:
            raise _oma_error(exc) from None
        return vault_pb2.RotateMasterKeyResponse(key_id=key_id, reencrypted_count=count)
