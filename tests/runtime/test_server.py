"""The runtime over real sockets: health, reflection, auth, errors, trace, TLS, listening."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import Pki, ProbeServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from runtime_probe import ACTION, BIG_UNKNOWN_FIELD, COUNT, ProbeState, ServiceSpec

from oma.runtime import trace
from oma.runtime.client import ClientTls, connect
from oma.runtime.errors import error_info
from oma.runtime.server import ServerTls

SERVING = health_pb2.HealthCheckResponse.SERVING


async def _fails(awaitable: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await awaitable
    return caught.value


async def _stream_fails(call: Any) -> tuple[int, grpc.aio.AioRpcError]:
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in call:
            received += 1
    return received, caught.value


async def test_health_serves_every_service_and_overall(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    async with probe.channel(role=None) as channel:  # no token: health is exempt
        health = health_pb2_grpc.HealthStub(channel)
        for name in ["", *(s.name for s in specs)]:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == SERVING, name
        error = await _fails(health.Check(health_pb2.HealthCheckRequest(service="no.such.Svc")))
        assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_every_registered_service(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    async with probe.channel(role=None) as channel:  # no token: reflection is exempt
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask(request: reflection_pb2.ServerReflectionRequest) -> Any:
            async for reply in stub.ServerReflectionInfo(iter([request])):
                return reply
            raise AssertionError("no reflection reply")

        reply = await ask(reflection_pb2.ServerReflectionRequest(list_services=""))
        listed = {s.name for s in reply.list_services_response.service}
        assert {s.name for s in specs} <= listed
        assert "grpc.health.v1.Health" in listed
        # grpcurl-style describe: the file defining a service resolves, with its contract.
        reply = await ask(
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=specs[0].name)
        )
        assert reply.file_descriptor_response.file_descriptor_proto


async def test_unary_and_stream_succeed_with_the_right_role(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    for spec in specs:
        role = "client" if "client" in _roles(spec, spec.unary) else "harness"
        async with probe.channel(role=role) as channel:
            stub = spec.stub(channel)
            await getattr(stub, spec.unary.name)(spec.request(spec.unary))
            assert probe.state.seen[-1].role == role
            if spec.stream is not None:
                stream_role = sorted(_roles(spec, spec.stream) - {"admin"} or {"admin"})[0]
                async with probe.channel(role=stream_role) as stream_channel:
                    call = getattr(spec.stub(stream_channel), spec.stream.name)(
                        spec.request(spec.stream), metadata=((COUNT, "4"),)
                    )
                    assert len([m async for m in call]) == 4
                    assert await call.code() == grpc.StatusCode.OK


def _roles(spec: ServiceSpec, method: Any) -> set[str]:
    from oma.runtime.auth import method_rule

    rule = method_rule(f"/{spec.name}/{method.name}")
    return set(rule.roles) | {"admin"}


async def test_missing_token_is_unauthenticated(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    spec = specs[0]
    async with probe.channel(role=None) as channel:
        error = await _fails(spec.stub(channel).GetCapabilities(spec.request(spec.unary)))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    info = error_info(error)
    assert info is not None and info.reason == "TOKEN_MISSING" and info.domain == "oma.dev"
    assert f"/{spec.name}/GetCapabilities" in (error.details() or "")
    assert "Bearer" in (error.details() or "")


async def test_unknown_or_malformed_token_is_unauthenticated(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    spec = specs[0]
    async with probe.channel(role=None, token="not-a-token-this-server-issued") as channel:
        error = await _fails(spec.stub(channel).GetCapabilities(spec.request(spec.unary)))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(error).reason == "TOKEN_INVALID"  # type: ignore[union-attr]
    async with probe.channel(role=None) as channel:
        good = probe.tokens.token_for("client")
        error = await _fails(
            spec.stub(channel).GetCapabilities(
                spec.request(spec.unary), metadata=(("authorization", f"Basic {good}"),)
            )
        )
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(error).reason == "TOKEN_INVALID"  # type: ignore[union-attr]
    assert "Bearer <token>" in (error.details() or "")


async def test_stream_checks_the_token_too(probe: ProbeServer, specs: list[ServiceSpec]) -> None:
    spec = next(s for s in specs if s.stream is not None)
    assert spec.stream is not None
    async with probe.channel(role=None) as channel:
        call = getattr(spec.stub(channel), spec.stream.name)(spec.request(spec.stream))
        received, error = await _stream_fails(call)
    assert received == 0
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(error).reason == "TOKEN_MISSING"  # type: ignore[union-attr]


async def test_wrong_role_is_permission_denied_and_admin_may_call_anything(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    checked = 0
    for spec in specs:
        for method in spec.descriptor.methods:
            allowed = _roles(spec, method)
            forbidden = sorted({"client", "harness", "sandbox_server"} - allowed)
            if not forbidden or method.client_streaming:
                continue
            from oma.runtime.auth import method_rule

            if method_rule(f"/{spec.name}/{method.name}").request_authenticated:
                continue
            async with probe.channel(role=forbidden[0]) as channel:
                call = getattr(spec.stub(channel), method.name)(spec.request(method))
                if method.server_streaming:
                    _, error = await _stream_fails(call)
                else:
                    error = await _fails(call)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED, method.full_name
            assert error_info(error).reason == "ROLE_FORBIDDEN"  # type: ignore[union-attr]
            details = error.details() or ""
            assert f"/{spec.name}/{method.name}" in details and "admin" in details
            assert f"'{forbidden[0]}'" in details
            # Admin passes the role check: the call reaches the probe, which implements only
            # GetCapabilities and one stream; anything else gets as far as UNIMPLEMENTED.
            implemented = method.name in (spec.unary.name, getattr(spec.stream, "name", None))
            async with probe.channel(role="admin") as channel:
                call = getattr(spec.stub(channel), method.name)(spec.request(method))
                if implemented:
                    if method.server_streaming:
                        assert [m async for m in call]
                    else:
                        await call
                else:
                    if method.server_streaming:
                        _, error = await _stream_fails(call)
                    else:
                        error = await _fails(call)
                    assert error.code() == grpc.StatusCode.UNIMPLEMENTED, method.full_name
            checked += 1
    assert checked > 0


async def test_request_authenticated_method_needs_no_token(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    from oma.runtime.auth import method_rule

    candidates = [
        (spec, m)
        for spec in specs
        for m in spec.descriptor.methods
        if method_rule(f"/{spec.name}/{m.name}").request_authenticated
        and not m.server_streaming
        and not m.client_streaming
    ]
    if not candidates:
        pytest.skip("no request-authenticated unary method in the contracts yet")
    spec, method = candidates[0]
    async with probe.channel(role=None) as channel:
        error = await _fails(getattr(spec.stub(channel), method.name)(spec.request(method)))
    # Past auth, into the (unimplemented) probe handler.
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_oma_error_arrives_with_error_info(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    spec = specs[0]
    async with probe.channel() as channel:
        error = await _fails(
            spec.stub(channel).GetCapabilities(
                spec.request(spec.unary), metadata=((ACTION, "error"),)
            )
        )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "probe: field `x` is malformed"
    info = error_info(error)
    assert info is not None
    assert (info.domain, info.reason, dict(info.metadata)) == (
        "oma.dev",
        "INVALID_FIELD",
        {"field": "x"},
    )


async def test_oma_error_mid_stream_arrives_after_the_messages(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    spec = next(s for s in specs if s.stream is not None)
    assert spec.stream is not None
    for style in ("yield", "write"):
        async with probe.channel() as channel:
            call = getattr(spec.stub(channel), spec.stream.name)(
                spec.request(spec.stream),
                metadata=((ACTION, "error"), (COUNT, "2"), ("x-probe-style", style)),
            )
            received, error = await _stream_fails(call)
        assert received == 2, style
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(error).reason == "SANDBOX_TERMINATED"  # type: ignore[union-attr]


async def test_unexpected_exception_is_internal_with_a_logged_id(
    probe: ProbeServer, specs: list[ServiceSpec], caplog: pytest.LogCaptureFixture
) -> None:
    spec = next(s for s in specs if s.stream is not None)
    assert spec.stream is not None
    caplog.set_level(logging.ERROR, logger="oma.runtime")
    async with probe.channel() as channel:
        stub = spec.stub(channel)
        unary_error = await _fails(
            stub.GetCapabilities(spec.request(spec.unary), metadata=((ACTION, "crash"),))
        )
        call = getattr(stub, spec.stream.name)(
            spec.request(spec.stream), metadata=((ACTION, "crash"), (COUNT, "1"))
        )
        received, stream_error = await _stream_fails(call)
    assert received == 1
    for error in (unary_error, stream_error):
        assert error.code() == grpc.StatusCode.INTERNAL
        info = error_info(error)
        assert info is not None and info.reason == "INTERNAL"
        error_id = info.metadata["error_id"]
        assert error_id in (error.details() or "")
        assert "crashed on purpose" not in (error.details() or "")  # no internals leak
        logged = [r for r in caplog.records if error_id in r.getMessage()]
        assert logged and logged[0].exc_info is not None


async def test_traceparent_from_the_client_is_seen_by_the_handler(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    spec = specs[0]
    sent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with probe.channel() as channel:
        await spec.stub(channel).GetCapabilities(
            spec.request(spec.unary),
            metadata=(("traceparent", sent), ("tracestate", "vendor=abc")),
        )
        seen = probe.state.seen[-1].trace
        assert seen is not None
        assert seen.traceparent == sent and seen.tracestate == "vendor=abc"
        # Through the contextvar, as a client inside a trace would send it.
        ctx = trace.TraceContext.new()
        with trace.use(ctx):
            await spec.stub(channel).GetCapabilities(spec.request(spec.unary))
        seen = probe.state.seen[-1].trace
        assert seen is not None and seen.trace_id == ctx.trace_id
        assert seen.parent_id != ctx.parent_id  # the outgoing call is a child span
        # No trace at all: the server starts one, so every handler is in a trace.
        await spec.stub(channel).GetCapabilities(spec.request(spec.unary))
        fresh = probe.state.seen[-1].trace
        assert fresh is not None and fresh.trace_id != ctx.trace_id


async def test_a_server_calling_a_server_passes_the_trace_on(
    start_probe: Any, specs: list[ServiceSpec]
) -> None:
    downstream = await start_probe()
    upstream_state = ProbeState(
        relay_to=downstream.address,
        relay_token=downstream.tokens.token_for("admin"),
        relay_service=specs[-1],
    )
    upstream = await start_probe(state=upstream_state)
    sent = trace.TraceContext.new()
    spec = specs[0]
    async with upstream.channel() as channel:
        with trace.use(sent):
            await spec.stub(channel).GetCapabilities(
                spec.request(spec.unary), metadata=((ACTION, "relay"),)
            )
    at_upstream = upstream.state.seen[-1].trace
    at_downstream = downstream.state.seen[-1].trace
    assert at_upstream is not None and at_downstream is not None
    assert at_upstream.trace_id == at_downstream.trace_id == sent.trace_id
    assert at_downstream.parent_id != at_upstream.parent_id


async def test_mtls_rejects_a_client_without_a_certificate(
    start_probe: Any, pki: Pki, specs: list[ServiceSpec]
) -> None:
    server = await start_probe(
        tls=ServerTls(cert=pki.server_cert, key=pki.server_key, client_ca=pki.ca)
    )
    spec = specs[0]
    token = server.tokens.token_for("admin")
    async with connect(server.address, token=token, tls=ClientTls(ca=pki.ca)) as channel:
        error = await _fails(
            spec.stub(channel).GetCapabilities(spec.request(spec.unary), timeout=10)
        )
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    with_cert = ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
    async with connect(server.address, token=token, tls=with_cert) as channel:
        await spec.stub(channel).GetCapabilities(spec.request(spec.unary), timeout=10)
    # And a plaintext client cannot talk to a TLS server at all.
    async with connect(server.address, token=token) as channel:
        error = await _fails(
            spec.stub(channel).GetCapabilities(spec.request(spec.unary), timeout=10)
        )
    assert error.code() == grpc.StatusCode.UNAVAILABLE


async def test_listens_on_a_unix_socket(
    start_probe: Any, tmp_path: Path, specs: list[ServiceSpec]
) -> None:
    path = tmp_path / "oma.sock"
    # A socket file left behind by a crashed server must not block the next start.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    server = await start_probe(listen=f"unix:{path}")
    assert server.address == f"unix:{path}"
    spec = specs[0]
    async with server.channel() as channel:
        await spec.stub(channel).GetCapabilities(spec.request(spec.unary))
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
    # A live server's socket is never stolen.
    with pytest.raises(OSError, match="another server"):
        await start_probe(listen=f"unix:{path}")
    await server.running.stop(0)
    assert not path.exists()


async def test_port_zero_gives_a_dialable_address_and_busy_port_fails(start_probe: Any) -> None:
    server = await start_probe(listen="0.0.0.0:0")
    host, _, port = server.address.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0
    with pytest.raises(OSError, match="cannot listen"):
        await start_probe(listen=f"127.0.0.1:{port}")


async def test_messages_over_the_limit_are_refused_both_ways(
    start_probe: Any, specs: list[ServiceSpec]
) -> None:
    server = await start_probe(max_message_bytes=1024)
    spec = specs[0]
    method = f"/{spec.name}/GetCapabilities"
    async with server.channel() as channel:
        # Raw bytes through the generic (unregistered) path: 4 KiB of unknown field.
        call = channel.unary_unary(method)
        error = await _fails(call(BIG_UNKNOWN_FIELD))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await call(b"") == b""  # a small request of the same method still works
        # The server will not send more than the limit either.
        error = await _fails(
            spec.stub(channel).GetCapabilities(
                spec.request(spec.unary), metadata=((ACTION, "big"),)
            )
        )
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    async with server.channel(role=None) as channel:
        # The generic path is guarded like the registered one.
        error = await _fails(channel.unary_unary(method)(b""))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_tls_server_name_override(
    start_probe: Any, pki: Pki, specs: list[ServiceSpec]
) -> None:
    server = await start_probe(tls=ServerTls(cert=pki.server_cert, key=pki.server_key))
    spec = specs[0]
    token = server.tokens.token_for("admin")
    good = ClientTls(ca=pki.ca, server_name="localhost")
    async with connect(server.address, token=token, tls=good) as channel:
        await spec.stub(channel).GetCapabilities(spec.request(spec.unary), timeout=10)
    wrong = ClientTls(ca=pki.ca, server_name="not-this-server.example")
    async with connect(server.address, token=token, tls=wrong) as channel:
        error = await _fails(
            spec.stub(channel).GetCapabilities(spec.request(spec.unary), timeout=10)
        )
    assert error.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_service_can_report_itself_not_serving(
    probe: ProbeServer, specs: list[ServiceSpec]
) -> None:
    name = specs[0].name
    async with probe.channel(role=None) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        await probe.running.set_serving(name, False)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await probe.running.set_serving(name, True)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == SERVING
