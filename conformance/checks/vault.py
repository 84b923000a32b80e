"""VaultService checks: write-only credentials, session tokens, host allow-lists, injection
with scrubbing, revocation and audit.

The proxy checks start a small HTTP upstream on 127.0.0.1 of the machine running the suite,
so run the suite on the vault's host (as CI does) for them to reach it."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from oma.conformance.checks._util import expect_error, unique
from oma.conformance.registry import check
from oma.conformance.target import Target
from oma.vault.v1 import vault_pb2 as pb


class _EchoHandler(BaseHTTPRequestHandler):
    """Answers every GET with the request's headers as JSON: an upstream that echoes secrets."""

    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        headers = dict(self.headers.items())
        type(self).seen.append(headers)
        body = json.dumps(headers).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


@contextmanager
def _echo_upstream() -> Iterator[tuple[int, list[dict[str, str]]]]:
    class Echo(_EchoHandler):
        seen: list[dict[str, str]] = []

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], Echo.seen
    finally:
        server.shutdown()
        server.server_close()


def _admin(target: Target) -> Any:
    return target.stub("vault", "admin")


async def _bearer_credential(target: Target, secret: str, port: int = 0) -> str:
    response = await _admin(target).CreateCredential(pb.CreateCredentialRequest(
        credential_id=unique("cred"), description="conformance",
        allowed_hosts=[pb.AllowedHost(host="127.0.0.1", port=port)],
        secret=pb.CredentialSecret(bearer=pb.BearerSecret(token=secret))))
    return str(response.credential.credential_id)


async def _session_token(target: Target, credential_id: str) -> tuple[str, str]:
    session_id = unique("session")
    issued = await _admin(target).IssueSessionToken(pb.IssueSessionTokenRequest(
        session_id=session_id, credential_ids=[credential_id]))
    return session_id, str(issued.session_token)


def _proxy(target: Target, token: str, credential_id: str, url: str) -> Any:
    # Proxy authenticates by the session token in the request: no bearer token is sent.
    return target.stub("vault", role="").Proxy(pb.ProxyRequest(
        session_token=token, credential_id=credential_id,
        request=pb.HttpRequest(method="GET", url=url)))


@check("vault", "VAULT-CRED-001", "VAULT-SECRET-001", "VAULT-CRED-006")
async def check_credentials_are_write_only(target: Target) -> None:
    secret = "conformance-" + secrets.token_hex(16)
    credential_id = await _bearer_credential(target, secret)
    listed, token = [], ""
    while True:
        page = await _admin(target).ListCredentials(pb.ListCredentialsRequest(page_token=token))
        listed.extend(page.credentials)
        token = page.next_page_token
        if not token:
            break
    mine = [c for c in listed if c.credential_id == credential_id]
    assert len(mine) == 1, "the new credential is not listed exactly once"
    assert secret.encode() not in page.SerializeToString() + mine[0].SerializeToString()


@check("vault", "VAULT-CRED-004", "VAULT-CRED-005", "VAULT-TOKEN-002")
async def check_unknown_credentials_are_not_found(target: Target) -> None:
    missing = unique("missing")
    await expect_error(_admin(target).DeleteCredential(pb.DeleteCredentialRequest(
        credential_id=missing)), grpc.StatusCode.NOT_FOUND, "CREDENTIAL_NOT_FOUND")
    await expect_error(_admin(target).IssueSessionToken(pb.IssueSessionTokenRequest(
        session_id=unique("s"), credential_ids=[missing])),
        grpc.StatusCode.NOT_FOUND, "CREDENTIAL_NOT_FOUND")


@check("vault", "VAULT-PROXY-001", "VAULT-TOKEN-004")
async def check_unknown_and_revoked_session_tokens_are_refused(target: Target) -> None:
    credential_id = await _bearer_credential(target, secrets.token_hex(16))
    await expect_error(_proxy(target, "not-a-session-token", credential_id, "http://127.0.0.1:9/"),
                       grpc.StatusCode.UNAUTHENTICATED, "SESSION_TOKEN_INVALID")
    session_id, token = await _session_token(target, credential_id)
    await _admin(target).RevokeSessionTokens(pb.RevokeSessionTokensRequest(session_id=session_id))
    await expect_error(_proxy(target, token, credential_id, "http://127.0.0.1:9/"),
                       grpc.StatusCode.UNAUTHENTICATED, "SESSION_TOKEN_INVALID")


@check("vault", "VAULT-PROXY-002", "VAULT-AUDIT-001")
async def check_a_host_outside_the_allow_list_is_refused_and_audited(target: Target) -> None:
    credential_id = await _bearer_credential(target, secrets.token_hex(16), port=1)
    session_id, token = await _session_token(target, credential_id)
    await expect_error(_proxy(target, token, credential_id, "http://localhost:1/steal"),
                       grpc.StatusCode.PERMISSION_DENIED, "HOST_NOT_ALLOWED")
    audit = await _admin(target).ListAudit(pb.ListAuditRequest(session_id=session_id))
    assert audit.records, "a refused proxy call left no audit record"


@check("vault", "VAULT-PROXY-004", "VAULT-PROXY-005")
async def check_the_secret_is_injected_and_every_echo_scrubbed(target: Target) -> None:
    secret = "conformance-" + secrets.token_hex(16)
    with _echo_upstream() as (port, seen):
        credential_id = await _bearer_credential(target, secret, port=port)
        _, token = await _session_token(target, credential_id)
        response = await _proxy(target, token, credential_id, f"http://127.0.0.1:{port}/echo")
        await asyncio.sleep(0)
    assert response.status_code == 200, response.status_code
    assert seen and seen[-1].get("Authorization") == f"Bearer {secret}", "secret not injected"
    assert secret.encode() not in response.SerializeToString(), "the echoed secret came back"
    assert response.redaction_count >= 1
