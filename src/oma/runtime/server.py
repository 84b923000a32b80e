"""Start, run and gracefully stop an OMA gRPC server (`grpc.aio`).

`start_server([Service(...), ...], ServerOptions(...))` gives a `RunningServer` that:
- listens on `host:port` (port 0 picks a free port), or `unix:/path`; `.address` is always
  dialable (`127.0.0.1:41234`, `unix:/path`), with TLS and optional mTLS (`ServerTls`);
- serves `grpc.health.v1.Health` (the overall "" service and every registered service
  SERVING) and server reflection (v1alpha) for every registered service, both without a token
  ([COMMON-AUTH-002]);
- checks each OMA call's bearer token against the method's `(oma.common.v1.auth)` option,
  exposes the caller's role (`oma.runtime.auth.current_role()`) and trace context
  (`oma.runtime.trace.current()`) to handlers, and turns `OmaError` into a status with
  `ErrorInfo`, any other exception into `INTERNAL` (reason `INTERNAL`, id logged);
- applies `max_message_bytes` to sends and receives, and keepalive settings;
- stops gracefully ([COMMON-SHUTDOWN-001]) in `stop(grace)`: health flips to NOT_SERVING, new
  OMA calls get `UNAVAILABLE`/`SERVER_SHUTTING_DOWN` (health and reflection keep answering),
  calls with a unary response in flight get up to `grace` seconds to finish, then every open
  response stream (and any unary call still running past the grace) ends with
  `UNAVAILABLE`/`SERVER_SHUTTING_DOWN` — its handler is cancelled, so it should roll back
  on `CancelledError` — then the server closes.
  Handlers may `await shutting_down()` to end a stream on their own terms first.

`run_until_signal(running)` waits for SIGTERM or SIGINT and then stops gracefully; a second
signal ends every call at once. `running.set_serving(service, bool)` lets a server report a
service NOT_SERVING (e.g. its database is down) and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_reflection.v1alpha import reflection

from oma.runtime._handlers import CallTracker, HandlerWrapper, Registrar, current_tracker
from oma.runtime.auth import TokenTable

logger = logging.getLogger("oma.runtime")

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_FLUSH_SECONDS = 2.0  # time aborted calls get to deliver their status
_CLOSE_SECONDS = 0.5  # then gRPC cancels whatever is left
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerTls:
    """Server certificate and key (PEM files); with `client_ca`, clients must present a
    certificate signed by it (mTLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How a server listens and behaves. `tokens` is required: there is no unauthenticated
    mode (use `TokenTable.generate()` in tests)."""

    tokens: TokenTable
    listen: str = "127.0.0.1:0"
    tls: ServerTls | None = None
    grace_seconds: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Server pings idle connections this often and drops them if no ack within the timeout.
    keepalive_time_seconds: float = 60.0
    keepalive_timeout_seconds: float = 20.0
    # Clients may ping this often without data (oma clients ping every 30 s).
    min_client_ping_interval_seconds: float = 10.0
    reflection: bool = True
    grpc_options: tuple[tuple[str, Any], ...] = field(default=())

    def channel_args(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_seconds * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_seconds * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            (
                "grpc.http2.min_ping_interval_without_data_ms",
                int(self.min_client_ping_interval_seconds * 1000),
            ),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.so_reuseport", 0),
            *self.grpc_options,
        ]


@dataclass(frozen=True)
class Service:
    """One gRPC service to serve: the servicer instance, the generated
    `add_<Name>Servicer_to_server` function, and the full service name
    (`oma.session.v1.SessionService`)."""

    servicer: Any
    add_to_server: Callable[[Any, aio.Server], None]
    name: str


class RunningServer:
    """A started server. `address` is dialable; `stop()` is graceful and idempotent."""

    def __init__(
        self,
        server: aio.Server,
        address: str,
        options: ServerOptions,
        services: Sequence[Service],
        health: health_aio.HealthServicer,
        tracker: CallTracker,
        unix_path: Path | None,
    ) -> None:
        self.server = server
        self.address = address
        self.options = options
        self.services = tuple(services)
        self.health = health
        self._tracker = tracker
        self._unix_path = unix_path
        self._stop_task: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()

    @property
    def tls(self) -> bool:
        return self.options.tls is not None

    @property
    def shutting_down(self) -> bool:
        return self._tracker.shutting_down.is_set()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful stop ([COMMON-SHUTDOWN-001]); concurrent and repeated calls share one."""
        if self._stop_task is None:
            grace = self.options.grace_seconds if grace is None else grace
            self._stop_task = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self._stop_task)

    def hurry(self) -> None:
        """Cut a graceful stop in progress short: end all calls now (a second SIGTERM)."""
        self._hurry.set()

    async def set_serving(self, service: str, serving: bool) -> None:
        """Report one service (or "" for the whole server) as SERVING or NOT_SERVING, e.g.
        while its database is unreachable. Ignored once shutdown has begun."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else NOT_SERVING
        await self.health.set(service, status)

    async def _stop(self, grace: float) -> None:
        self._tracker.shutting_down.set()
        await self.health.enter_graceful_shutdown()
        unary_done = asyncio.ensure_future(self._tracker.wait_idle(streaming=False))
        hurried = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait(
            {unary_done, hurried}, timeout=max(grace, 0.0), return_when=asyncio.FIRST_COMPLETED
        )
        unary_done.cancel()
        hurried.cancel()
        streams = self._tracker.abort(streaming=True)
        late = self._tracker.abort(streaming=False)  # unary calls still running past the grace
        if streams or late:
            logger.info(
                "shutdown: ending %d open stream(s) and %d unary call(s) past the grace "
                "with UNAVAILABLE",
                streams,
                late,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_all_idle(), _FLUSH_SECONDS)
        # What is left (health watchers, reflection streams, handlers that ignored their
        # cancellation) is cut by gRPC itself.
        await self.server.stop(_CLOSE_SECONDS)
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._unix_path.unlink()

    async def _wait_all_idle(self) -> None:
        await self._tracker.wait_idle(streaming=True)
        await self._tracker.wait_idle(streaming=False)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def shutting_down() -> None:
    """Inside a handler: return once this call's server begins a graceful shutdown.

    A streaming handler can race it against its own work and end the stream itself, e.g.
    with `raise oma.runtime.errors.shutting_down_error()`.
    """
    tracker = current_tracker()
    if tracker is None:
        raise RuntimeError("shutting_down() is only meaningful inside an OMA call handler")
    await tracker.shutting_down.wait()


def is_shutting_down() -> bool:
    """Inside a handler: whether this call's server is shutting down."""
    tracker = current_tracker()
    return tracker is not None and tracker.shutting_down.is_set()


def _check_service_names(services: Sequence[Service]) -> None:
    pool = descriptor_pool.Default()
    for service in services:
        try:
            pool.FindServiceByName(service.name)
        except KeyError:
            raise ValueError(
                f"service {service.name!r} is not in the protobuf descriptor pool: give its "
                "full name (package.Service) and import its _pb2 module"
            ) from None


def _prepare_unix_socket(path: Path) -> None:
    """Remove a socket file left by a crashed server; refuse to steal a live one."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"cannot listen on unix:{path}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise OSError(f"cannot listen on unix:{path}: another server is listening there")


def _unix_path(listen: str) -> Path | None:
    if not listen.startswith("unix:"):
        return None
    rest = listen[len("unix:") :]
    # unix:///abs/path and unix:/abs/path and unix:relative are all gRPC spellings.
    return Path(rest[2:] if rest.startswith("//") else rest)


def _dialable(listen: str, port: int) -> str:
    host, _, _ = listen.rpartition(":")
    if host in ("", "0.0.0.0", "*"):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


async def start_server(services: Sequence[Service], options: ServerOptions) -> RunningServer:
    """Build, bind and start a server for `services`; raises OSError if it cannot listen."""
    _check_service_names(services)
    tracker = CallTracker()
    server = aio.server(options=options.channel_args())
    registrar = Registrar(server, HandlerWrapper(options.tokens, tracker))
    for service in services:
        # The registrar wraps each method handler; the generated function cannot tell.
        service.add_to_server(service.servicer, registrar)  # type: ignore[arg-type]

    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for service in services:
        await health.set(service.name, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)

    if options.reflection:
        names = [s.name for s in services]
        names += [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        names += [reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, server)

    unix_path = _unix_path(options.listen)
    if unix_path is not None:
        _prepare_unix_socket(unix_path)
    try:
        if options.tls is not None:
            port = server.add_secure_port(options.listen, options.tls.credentials())
        else:
            port = server.add_insecure_port(options.listen)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {options.listen}: {exc}") from None
    if unix_path is None and port == 0:
        raise OSError(f"cannot listen on {options.listen} (address in use or invalid)")
    address = options.listen if unix_path is not None else _dialable(options.listen, port)
    await server.start()
    logger.info("serving %s on %s", ", ".join(s.name for s in services), address)
    return RunningServer(server, address, options, services, health, tracker, unix_path)


async def run_until_signal(
    running: RunningServer, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
) -> None:
    """Serve until one of `signals` arrives (or the server stops), then stop gracefully.

    A second signal during the grace period ends every call at once.
    """
    loop = asyncio.get_running_loop()
    received = asyncio.Event()

    def on_signal() -> None:
        if received.is_set():
            logger.warning("second signal: ending all calls now")
            running.hurry()
        received.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    try:
        terminated = asyncio.ensure_future(running.wait_for_termination())
        signalled = asyncio.ensure_future(received.wait())
        await asyncio.wait({terminated, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if received.is_set():
            logger.info(
                "signal received; shutting down (grace %.1fs)", running.options.grace_seconds
            )
            await running.stop()
        terminated.cancel()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
