"""Small helpers to build vault requests in tests."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from oma.runtime.errors import error_info
from oma.vault.v1 import vault_pb2 as pb


def hosts(*specs: tuple[str, int]) -> list[pb.AllowedHost]:
    return [pb.AllowedHost(host=h, port=p) for h, p in specs]


async def create(
    stub: Any,
    secret: pb.CredentialSecret,
    allowed: list[pb.AllowedHost],
    credential_id: str = "",
    **kw: Any,
) -> pb.Credential:
    response = await stub.CreateCredential(
        pb.CreateCredentialRequest(
            credential_id=credential_id, allowed_hosts=allowed, secret=secret, **kw
        )
    )
    return response.credential


async def issue(stub: Any, session_id: str, *credential_ids: str, ttl: float = 0) -> str:
    request = pb.IssueSessionTokenRequest(session_id=session_id, credential_ids=credential_ids)
    if ttl:
        request.ttl.CopyFrom(Duration(seconds=int(ttl), nanos=int((ttl % 1) * 1e9)))
    return (await stub.IssueSessionToken(request)).session_token


def http(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes = b""
) -> pb.HttpRequest:
    return pb.HttpRequest(
        method=method,
        url=url,
        body=body,
        headers=[pb.HttpHeader(name=k, value=v) for k, v in (headers or {}).items()],
    )


async def proxy(stub: Any, token: str, credential_id: str, url: str, **kw: Any) -> pb.ProxyResponse:
    timeout = kw.pop("timeout", None)
    request = pb.ProxyRequest(
        session_token=token, credential_id=credential_id, request=http(url, **kw)
    )
    if timeout:
        request.timeout.CopyFrom(Duration(seconds=int(timeout), nanos=int((timeout % 1) * 1e9)))
    return await stub.Proxy(request)


async def proxy_stream(
    stub: Any, token: str, credential_id: str, url: str, **kw: Any
) -> tuple[pb.ResponseHead, list[bytes]]:
    call = stub.ProxyStream(
        pb.ProxyStreamRequest(
            session_token=token, credential_id=credential_id, request=http(url, **kw)
        )
    )
    head = None
    chunks: list[bytes] = []
    async for message in call:
        if message.HasField("head"):
            assert head is None, "head sent twice"
            assert not chunks, "head after body"
            head = message.head
        else:
            assert head is not None, "body before head"
            chunks.append(message.body_chunk)
    assert head is not None
    return head, chunks


async def expect_error(awaitable: Any, code: grpc.StatusCode, reason: str) -> Any:
    try:
        await awaitable
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == code, (exc.code(), exc.details())
        info = error_info(exc)
        assert info is not None and info.reason == reason, (info, exc.details())
        assert info.domain == "oma.dev"
        return exc
    raise AssertionError(f"expected {code.name}/{reason}, the call succeeded")


def header(headers: Any, name: str) -> list[str]:
    return [h.value for h in headers if h.name.lower() == name.lower()]
