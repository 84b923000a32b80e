"""The injecting, scrubbing proxy against real loopback upstreams."""

from __future__ import annotations

import asyncio
import gzip

import grpc
from vault_calls import create, expect_error, header, hosts, issue, proxy, proxy_stream
from vault_upstreams import MARKER, LoopbackServer, Recorder, echo_forms

from oma.vault.v1 import vault_pb2 as pb

# Characters that change under every encoding: '/', '+', '=', '"', '\\', '%' and space.
SECRET = 'sk/live+Zx9=q"w\\e%r tZZ-0123456789'


def bearer(token: str = SECRET) -> pb.CredentialSecret:
    return pb.CredentialSecret(bearer=pb.BearerSecret(token=token))


async def setup(vault, server, secret: pb.CredentialSecret | None = None, cid: str = "api") -> str:
    stub = vault.stub()
    await create(stub, secret or bearer(), hosts(("127.0.0.1", server.port)), credential_id=cid)
    return await issue(stub, "ses_1", cid)


def assert_scrubbed(blob: bytes, secret: str = SECRET) -> None:
    for name, form in echo_forms(secret).items():
        assert form.encode() not in blob, f"{name} form of the secret survived: {form!r}"


def all_bytes(response: pb.ProxyResponse) -> bytes:
    return response.body + b"".join(f"{h.name}: {h.value}\n".encode() for h in response.headers)


async def test_bearer_injected_and_every_echo_scrubbed(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    for url in (f"{echo_server.base}/forms", f"{echo_server.base}/forms?gzip=1"):
        response = await proxy(vault.stub("client"), token, "api", url)
        assert response.status_code == 200
        assert MARKER.encode() in response.body
        assert_scrubbed(all_bytes(response))
        assert b"[REDACTED]" in response.body
        assert header(response.headers, "X-Echo") == ["[REDACTED]"]
        assert response.redaction_count >= len(echo_forms(SECRET))
        assert header(response.headers, "content-length") == [str(len(response.body))]
        assert header(response.headers, "content-encoding") == []


async def test_each_kind_is_injected(vault, echo_server) -> None:
    stub = vault.stub()
    kinds = {
        "hdr": pb.CredentialSecret(header=pb.HeaderSecret(header_name="X-Api-Key", value=SECRET)),
        "basic": pb.CredentialSecret(basic=pb.BasicSecret(username="alice", password=SECRET)),
        "git": pb.CredentialSecret(git_token=pb.GitTokenSecret(token=SECRET)),
        "bear": bearer(),
    }
    for cid, secret in kinds.items():
        await create(stub, secret, hosts(("127.0.0.1", 0)), credential_id=cid)
    token = await issue(stub, "ses_k", *kinds)
    echo_server.server.config.app.state.expected = SECRET
    for cid in kinds:
        response = await proxy(
            stub,
            token,
            cid,
            f"{echo_server.base}/whoami",
            method="POST",
            body=b"hello",
            headers={"Authorization": "Bearer caller-forged", "X-Custom": "kept"},
        )
        assert response.status_code == 200, (cid, response.body)
        assert b'"body":"hello"' in response.body
        assert b'"x-custom":"kept"' in response.body


async def test_streamed_response_scrubbed_across_chunk_boundaries(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    stub = vault.stub("harness")
    for query in ("step=1", "step=2", "step=3", "step=5", "step=11", "gzip=1"):
        head, chunks = await proxy_stream(stub, token, "api", f"{echo_server.base}/stream?{query}")
        body = b"".join(chunks)
        assert head.status_code == 200
        assert header(head.headers, "content-length") == []
        assert header(head.headers, "content-encoding") == []
        assert body.count(MARKER.encode()) == len(echo_forms(SECRET)), query
        assert_scrubbed(body)
        assert body.count(b"[REDACTED]") >= len(echo_forms(SECRET))


async def test_host_not_allowed_and_audited(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    stub = vault.stub("client")
    await expect_error(
        proxy(stub, token, "api", f"http://localhost:{echo_server.port}/forms"),
        grpc.StatusCode.PERMISSION_DENIED,
        "HOST_NOT_ALLOWED",
    )
    await expect_error(
        proxy(stub, token, "api", f"http://127.0.0.1:{echo_server.port + 1}/x"),
        grpc.StatusCode.PERMISSION_DENIED,
        "HOST_NOT_ALLOWED",
    )
    await expect_error(
        proxy(stub, token, "api", "ftp://127.0.0.1/x"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    audit = await vault.stub().ListAudit(pb.ListAuditRequest(credential_id="api"))
    refused = [r for r in audit.records if r.outcome == "HOST_NOT_ALLOWED"]
    assert len(refused) == 2
    assert refused[0].session_id == "ses_1" and refused[0].action == "proxy"


async def test_cross_host_redirect_refused_without_contacting_it(vault, echo_server) -> None:
    recorder = Recorder()
    other = await LoopbackServer(recorder.app()).start()
    try:
        token = await setup(vault, echo_server)
        stub = vault.stub("client")
        away = f"http://localhost:{other.port}/steal"
        await expect_error(
            proxy(stub, token, "api", f"{echo_server.base}/redirect?to={away}"),
            grpc.StatusCode.PERMISSION_DENIED,
            "REDIRECT_REFUSED",
        )
        await expect_error(
            proxy_stream(stub, token, "api", f"{echo_server.base}/redirect?to={away}"),
            grpc.StatusCode.PERMISSION_DENIED,
            "REDIRECT_REFUSED",
        )
        assert recorder.hits == []
        same = await proxy(stub, token, "api", f"{echo_server.base}/redirect?to=/forms")
        assert same.status_code == 200 and MARKER.encode() in same.body
    finally:
        await other.stop()


async def test_token_errors(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    stub = vault.stub("client")
    url = f"{echo_server.base}/forms"
    await expect_error(
        proxy(stub, "omavst_bogus", "api", url),
        grpc.StatusCode.UNAUTHENTICATED,
        "SESSION_TOKEN_INVALID",
    )
    await expect_error(
        proxy(stub, "", "api", url), grpc.StatusCode.UNAUTHENTICATED, "SESSION_TOKEN_INVALID"
    )
    # Proxy takes no bearer token at all: the session token is enough.
    ok = await proxy(vault.stub("none"), token, "api", url)
    assert ok.status_code == 200
    await create(vault.stub(), bearer(SECRET + "2"), hosts(("127.0.0.1", 0)), credential_id="other")
    await expect_error(
        proxy(stub, token, "other", url),
        grpc.StatusCode.PERMISSION_DENIED,
        "CREDENTIAL_NOT_GRANTED",
    )
    short = await issue(vault.stub(), "ses_2", "api", ttl=0.5)
    await asyncio.sleep(0.8)
    await expect_error(
        proxy(stub, short, "api", url), grpc.StatusCode.UNAUTHENTICATED, "SESSION_TOKEN_INVALID"
    )
    revoked = await vault.stub("harness").RevokeSessionTokens(
        pb.RevokeSessionTokensRequest(session_id="ses_1")
    )
    assert revoked.revoked_count == 1
    await expect_error(
        proxy(stub, token, "api", url), grpc.StatusCode.UNAUTHENTICATED, "SESSION_TOKEN_INVALID"
    )
    again = await vault.stub().RevokeSessionTokens(
        pb.RevokeSessionTokensRequest(session_id="ses_1")
    )
    assert again.revoked_count == 0


async def test_deleted_credential_is_not_found(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    await vault.stub().DeleteCredential(pb.DeleteCredentialRequest(credential_id="api"))
    await expect_error(
        proxy(vault.stub("client"), token, "api", f"{echo_server.base}/forms"),
        grpc.StatusCode.NOT_FOUND,
        "CREDENTIAL_NOT_FOUND",
    )


async def test_size_limits_timeouts_and_unreachable(tmp_path, echo_server) -> None:
    from vault_server import start_vault, stop_vault

    v = await start_vault(
        tmp_path, max_request_bytes=1000, max_response_bytes=50_000, max_stream_bytes=200_000
    )
    try:
        token = await setup(v, echo_server)
        stub = v.stub("client")
        base = echo_server.base
        await expect_error(
            proxy(stub, token, "api", f"{base}/whoami", method="POST", body=b"x" * 1001),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "REQUEST_TOO_LARGE",
        )
        await expect_error(
            proxy(stub, token, "api", f"{base}/big?size=50001"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "RESPONSE_TOO_LARGE",
        )
        fits = await proxy(stub, token, "api", f"{base}/big?size=50000")
        assert len(fits.body) == 50_000
        head, chunks = await proxy_stream(stub, token, "api", f"{base}/big?size=150000")
        assert sum(len(c) for c in chunks) == 150_000 and head.status_code == 200
        await expect_error(
            proxy_stream(stub, token, "api", f"{base}/big?size=200001"),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "RESPONSE_TOO_LARGE",
        )
        await expect_error(
            proxy(stub, token, "api", f"{base}/slow?seconds=5", timeout=0.3),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "UPSTREAM_TIMEOUT",
        )
        await echo_server.stop()
        await expect_error(
            proxy(stub, token, "api", f"{base}/forms"),
            grpc.StatusCode.UNAVAILABLE,
            "UPSTREAM_UNREACHABLE",
        )
    finally:
        await stop_vault(v)


async def test_big_body_streams_back_in_small_chunks(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    _, chunks = await proxy_stream(
        vault.stub("harness"), token, "api", f"{echo_server.base}/big?size=20000000"
    )
    assert sum(len(c) for c in chunks) == 20_000_000
    assert max(len(c) for c in chunks) <= 64 * 1024


async def test_audit_rows_paged_and_secret_free(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    for _ in range(5):
        await proxy(vault.stub("client"), token, "api", f"{echo_server.base}/forms", method="POST")
    await expect_error(
        proxy(vault.stub("client"), "nope", "api", f"{echo_server.base}/forms"),
        grpc.StatusCode.UNAUTHENTICATED,
        "SESSION_TOKEN_INVALID",
    )
    records: list[pb.AuditRecord] = []
    page_token = ""
    while True:
        page = await vault.stub().ListAudit(pb.ListAuditRequest(page_size=2, page_token=page_token))
        records += page.records
        assert SECRET.encode() not in page.SerializeToString()
        page_token = page.next_page_token
        if not page_token:
            break
    ids = [r.audit_id for r in records]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == len(ids)
    proxied = [r for r in records if r.action == "proxy" and r.outcome == "OK"]
    assert len(proxied) == 5
    row = proxied[0]
    assert row.session_id == "ses_1" and row.credential_id == "api"
    assert row.host == f"127.0.0.1:{echo_server.port}" and row.method == "POST"
    assert row.http_status == 200 and row.actor.startswith("session-token:")
    assert row.time.seconds > 0
    assert any(r.outcome == "SESSION_TOKEN_INVALID" for r in records)
    assert {"create", "issue_token"} <= {r.action for r in records}
    filtered = await vault.stub().ListAudit(pb.ListAuditRequest(page_size=1, session_id="ses_1"))
    assert filtered.records[0].session_id == "ses_1" and filtered.next_page_token
    await expect_error(
        vault.stub().ListAudit(pb.ListAuditRequest(page_token=filtered.next_page_token)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )
    await expect_error(
        vault.stub().ListAudit(pb.ListAuditRequest(page_token="AAAA")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )


def test_gzip_helper_roundtrip() -> None:
    assert gzip.decompress(gzip.compress(b"x")) == b"x"


async def test_malformed_requests_are_invalid_arguments(vault, echo_server) -> None:
    token = await setup(vault, echo_server)
    stub = vault.stub("client")
    url = f"{echo_server.base}/whoami"
    for kw in (
        {"method": "GET /x HTTP/1.1\r\nX: y"},
        {"headers": {"X-Bad": "a\r\nInjected: 1"}},
        {"headers": {"Bad Name": "v"}},
    ):
        await expect_error(
            proxy(stub, token, "api", url, **kw), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"
        )
    await expect_error(
        proxy(stub, token, "api", "http://user:pw@127.0.0.1/"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
