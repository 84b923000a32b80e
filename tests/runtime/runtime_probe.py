"""Tiny servicers for every OMA service in the generated stubs, for the runtime tests.

Each probe servicer subclasses the real generated `*Servicer` and implements two methods:
`GetCapabilities` (unary) and the service's first server-streaming method, if it has one.
What they do is steered by request metadata, so the tests drive real RPCs of real contracts:

- `x-probe-action: error`  → raise `OmaError(INVALID_ARGUMENT, "INVALID_FIELD", ...)`
- `x-probe-action: crash`  → raise `RuntimeError` (the runtime must answer INTERNAL)
- `x-probe-action: slow`   → sleep `x-probe-seconds` before answering (shutdown tests)
- `x-probe-action: block`  → wait until the test sets `ProbeState.release`
- `x-probe-action: big`    → answer with a 4 KiB (unknown-field) response
- `x-probe-action: relay`  → call `GetCapabilities` on `ProbeState.relay_to` and answer
- `x-probe-action: hold`   → (streams) after `x-probe-count` messages, stay open forever
- `x-probe-action: until-shutdown` → (streams) after the messages, wait for the server's
  shutdown (`oma.runtime.server.shutting_down()`) and end the stream itself
- `x-probe-action: write`  → (streams) send with `context.write` instead of yielding

Run as a script it is a server CLI built on `oma.runtime.cli` (for the SIGTERM test):
`python tests/runtime/runtime_probe.py --listen 127.0.0.1:0 --tokens FILE`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import pkgutil
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

import oma
from oma.runtime import auth, trace
from oma.runtime.client import connect
from oma.runtime.errors import OmaError, shutting_down_error
from oma.runtime.server import Service, is_shutting_down, shutting_down

ACTION = "x-probe-action"
COUNT = "x-probe-count"
SECONDS = "x-probe-seconds"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# Field 2047, wire type 2, 4 KiB: valid for any message, kept and re-sent as an unknown field.
BIG_UNKNOWN_FIELD = _varint(2047 << 3 | 2) + _varint(4096) + b"x" * 4096


@dataclass(frozen=True)
class ServiceSpec:
    """One generated OMA service and the two methods the probe implements."""

    descriptor: ServiceDescriptor
    grpc_module: ModuleType
    unary: MethodDescriptor
    stream: MethodDescriptor | None

    @property
    def name(self) -> str:
        return self.descriptor.full_name

    def stub(self, channel: grpc.aio.Channel) -> Any:
        return getattr(self.grpc_module, f"{self.descriptor.name}Stub")(channel)

    def request(self, method: MethodDescriptor) -> Any:
        return message_factory.GetMessageClass(method.input_type)()


@dataclass
class Seen:
    method: str
    role: str | None
    trace: trace.TraceContext | None


@dataclass
class ProbeState:
    seen: list[Seen] = field(default_factory=list)
    relay_to: str | None = None
    relay_token: str | None = None
    relay_service: ServiceSpec | None = None
    started: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def oma_services() -> list[ServiceSpec]:
    """Every service of every `oma.<area>.v1` stub package that exists right now."""
    specs: list[ServiceSpec] = []
    for area in sorted(m.name for m in pkgutil.iter_modules(oma.__path__)):
        try:
            package = importlib.import_module(f"oma.{area}.v1")
        except ImportError:
            continue
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if not info.name.endswith("_pb2"):
                continue
            module = importlib.import_module(f"oma.{area}.v1.{info.name}")
            for service in module.DESCRIPTOR.services_by_name.values():
                grpc_module = importlib.import_module(f"oma.{area}.v1.{info.name}_grpc")
                methods = {m.name: m for m in service.methods}
                stream = next(
                    (m for m in service.methods if m.server_streaming and not m.client_streaming),
                    None,
                )
                specs.append(ServiceSpec(service, grpc_module, methods["GetCapabilities"], stream))
    return specs


def _metadata(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


def make_servicer(spec: ServiceSpec, state: ProbeState) -> Any:
    base = getattr(spec.grpc_module, f"{spec.descriptor.name}Servicer")
    unary_response = message_factory.GetMessageClass(spec.unary.output_type)

    async def unary(self: Any, request: Any, context: Any) -> Any:
        meta = _metadata(context)
        state.seen.append(Seen(spec.unary.name, auth.current_role(), trace.current()))
        action = meta.get(ACTION, "")
        await state.started.put(f"{spec.unary.name}:{action}")
        if action == "error":
            raise OmaError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_FIELD",
                "probe: field `x` is malformed",
                {"field": "x"},
            )
        if action == "crash":
            raise RuntimeError("probe crashed on purpose")
        if action == "slow":
            await asyncio.sleep(float(meta.get(SECONDS, "1")))
        if action == "block":
            await state.release.wait()
        if action == "big":
            return unary_response.FromString(BIG_UNKNOWN_FIELD)
        if action == "relay":
            assert state.relay_to is not None and state.relay_service is not None
            async with connect(state.relay_to, token=state.relay_token) as channel:
                target = state.relay_service
                await target.stub(channel).GetCapabilities(target.request(target.unary))
        return unary_response()

    methods: dict[str, Any] = {spec.unary.name: unary}

    if spec.stream is not None:
        stream_method = spec.stream
        stream_response = message_factory.GetMessageClass(stream_method.output_type)

        async def generate(meta: dict[str, str]) -> AsyncIterator[Any]:
            action = meta.get(ACTION, "")
            for _ in range(int(meta.get(COUNT, "3"))):
                yield stream_response()
            if action == "error":
                raise OmaError(
                    grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_TERMINATED", "probe: gone"
                )
            if action == "crash":
                raise RuntimeError("probe stream crashed on purpose")
            if action == "hold":
                await asyncio.Event().wait()
            if action == "until-shutdown":
                assert not is_shutting_down()
                await shutting_down()
                assert is_shutting_down()
                raise shutting_down_error()

        async def write(meta: dict[str, str], context: Any) -> None:
            async for response in generate(meta):
                await context.write(response)

        def stream(self: Any, request: Any, context: Any) -> Any:
            meta = _metadata(context)
            state.seen.append(Seen(stream_method.name, auth.current_role(), trace.current()))
            state.started.put_nowait(f"{stream_method.name}:{meta.get(ACTION, '')}")
            if meta.get(ACTION) == "write" or meta.get("x-probe-style") == "write":
                return write(meta, context)
            return generate(meta)

        methods[stream_method.name] = stream

    cls = type(f"Probe{spec.descriptor.name}", (base,), methods)
    return cls()


def probe_services(state: ProbeState, specs: list[ServiceSpec] | None = None) -> list[Service]:
    services = []
    for spec in specs if specs is not None else oma_services():
        add = getattr(spec.grpc_module, f"add_{spec.descriptor.name}Servicer_to_server")
        services.append(Service(make_servicer(spec, state), add, spec.name))
    return services


async def _main(argv: list[str]) -> int:
    from oma.runtime.cli import add_server_arguments, announce, server_options_from_args
    from oma.runtime.server import run_until_signal, start_server

    parser = argparse.ArgumentParser(prog="runtime_probe")
    add_server_arguments(parser, default_listen="127.0.0.1:0")
    args = parser.parse_args(argv)
    state = ProbeState()
    running = await start_server(probe_services(state), server_options_from_args(args))

    async def report_started() -> None:
        # Tells the test which handlers are running, so it signals at the right moment.
        while True:
            print(f"started {await state.started.get()}", flush=True)

    reporter = asyncio.ensure_future(report_started())
    announce("probe", running)
    await run_until_signal(running)
    reporter.cancel()
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1:])))
