"""Graceful shutdown ([COMMON-SHUTDOWN-001]): health flips, unary calls finish, open streams
end with UNAVAILABLE / SERVER_SHUTTING_DOWN — in process and on a real SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from runtime_probe import ACTION, COUNT, SECONDS, ServiceSpec

from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.runtime.errors import error_info

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROBE = Path(__file__).with_name("runtime_probe.py")


def _stream_spec(specs: list[ServiceSpec]) -> ServiceSpec:
    return next(s for s in specs if s.stream is not None)


async def _open_stream(stub: Any, spec: ServiceSpec) -> Any:
    """A stream that sends one message and then stays open; returns after that message."""
    assert spec.stream is not None
    call = getattr(stub, spec.stream.name)(
        spec.request(spec.stream), metadata=((ACTION, "hold"), (COUNT, "1"))
    )
    assert await call.read() is not grpc.aio.EOF
    return call


async def _stream_end(call: Any) -> grpc.aio.AioRpcError:
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError(f"stream ended with {await call.code()} instead of an error")


async def test_stop_lets_unary_finish_then_ends_streams(
    start_probe: Any, specs: list[ServiceSpec]
) -> None:
    server = await start_probe(grace_seconds=30)
    spec = _stream_spec(specs)
    async with server.channel() as channel:
        stub = spec.stub(channel)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == SERVING
        stream = await _open_stream(stub, spec)
        unary = asyncio.ensure_future(
            stub.GetCapabilities(spec.request(spec.unary), metadata=((ACTION, "block"),))
        )
        while await server.state.started.get() != "GetCapabilities:block":
            pass

        stopping = asyncio.ensure_future(server.running.stop())
        assert (await watch.read()).status == NOT_SERVING
        assert server.running.shutting_down

        # The server still answers health, but refuses new OMA calls with a reason.
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
        try:
            await stub.GetCapabilities(spec.request(spec.unary))
            raise AssertionError("a new call during shutdown was accepted")
        except grpc.aio.AioRpcError as refused:
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(refused).reason == "SERVER_SHUTTING_DOWN"  # type: ignore[union-attr]

        # The stream stays open while a unary call is in flight ...
        assert not stream.done()
        server.state.release.set()
        await unary  # ... which completes successfully,
        error = await _stream_end(stream)  # ... and then the stream is ended.
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(error).reason == "SERVER_SHUTTING_DOWN"  # type: ignore[union-attr]
        await stopping


async def test_sigterm_during_an_open_stream(tmp_path: Path, specs: list[ServiceSpec]) -> None:
    tokens = TokenTable.generate()
    tokens_file = tmp_path / "tokens.json"
    tokens.save(tokens_file)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PROBE),
        "--listen",
        "127.0.0.1:0",
        "--tokens",
        str(tokens_file),
        "--grace-seconds",
        "60",
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "OMA_HOME": str(tmp_path / "home")},
    )
    assert process.stdout is not None
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        assert line.startswith("oma probe serving on "), line
        address = line.rsplit(" ", 1)[1].strip()

        async def started(what: str) -> None:
            assert process.stdout is not None
            while (await process.stdout.readline()).decode().strip() != f"started {what}":
                pass

        spec = _stream_spec(specs)
        async with connect(address, token=tokens.token_for("admin")) as channel:
            stub = spec.stub(channel)
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=spec.name)
            )
            assert (await watch.read()).status == SERVING
            stream = await _open_stream(stub, spec)
            unary = asyncio.ensure_future(
                stub.GetCapabilities(
                    spec.request(spec.unary), metadata=((ACTION, "slow"), (SECONDS, "2"))
                )
            )
            await started("GetCapabilities:slow")

            process.send_signal(signal.SIGTERM)

            assert (await watch.read()).status == NOT_SERVING
            await unary  # the in-flight unary call completed within the grace period
            error = await _stream_end(stream)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(error).reason == "SERVER_SHUTTING_DOWN"  # type: ignore[union-attr]
        assert await asyncio.wait_for(process.wait(), 60) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_unary_calls_past_the_grace_end_with_unavailable(
    start_probe: Any, specs: list[ServiceSpec]
) -> None:
    server = await start_probe(grace_seconds=0.2)
    spec = specs[0]
    async with server.channel() as channel:
        unary = asyncio.ensure_future(
            spec.stub(channel).GetCapabilities(
                spec.request(spec.unary), metadata=((ACTION, "block"),)
            )
        )
        while await server.state.started.get() != "GetCapabilities:block":
            pass
        await server.running.stop()  # the blocked call is never released
        try:
            await unary
            raise AssertionError("a call past the grace period succeeded")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(error).reason == "SERVER_SHUTTING_DOWN"  # type: ignore[union-attr]


async def test_a_stream_can_end_itself_on_shutdown(
    start_probe: Any, specs: list[ServiceSpec]
) -> None:
    server = await start_probe(grace_seconds=30)
    spec = _stream_spec(specs)
    assert spec.stream is not None
    async with server.channel() as channel:
        call = getattr(spec.stub(channel), spec.stream.name)(
            spec.request(spec.stream), metadata=((ACTION, "until-shutdown"), (COUNT, "1"))
        )
        assert await call.read() is not grpc.aio.EOF
        await server.running.stop()
        error = await _stream_end(call)
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(error).reason == "SERVER_SHUTTING_DOWN"  # type: ignore[union-attr]
    # UNAVAILABLE (not INTERNAL) also means the handler's own is_shutting_down checks held.


async def test_hurry_cuts_the_grace_short(start_probe: Any, specs: list[ServiceSpec]) -> None:
    server = await start_probe(grace_seconds=3600)
    spec = specs[0]
    async with server.channel() as channel:
        unary = asyncio.ensure_future(
            spec.stub(channel).GetCapabilities(
                spec.request(spec.unary), metadata=((ACTION, "block"),)
            )
        )
        while await server.state.started.get() != "GetCapabilities:block":
            pass
        stopping = asyncio.ensure_future(server.running.stop())
        await asyncio.sleep(0)  # let the stop begin; hurry works at any point of it anyway
        server.running.hurry()  # what a second SIGTERM does
        await stopping  # returns although the grace is an hour and the call never finishes
        try:
            await unary
            raise AssertionError("the blocked call succeeded")
        except grpc.aio.AioRpcError as error:
            assert error_info(error).reason == "SERVER_SHUTTING_DOWN"  # type: ignore[union-attr]
