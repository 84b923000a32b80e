"""Running the scripted model server in-process: in the caller's event loop, or in a thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn

from oma.servers.harness.model_server.app import ServerState, build_app
from oma.servers.harness.model_server.script import as_book
from oma.servers.harness.model_server.ttft import Ttft
from oma.servers.harness.model_server.validate import warm_up


class QuietServer(uvicorn.Server):
    """A uvicorn server that leaves SIGINT/SIGTERM to the host process (a test, `oma demo`,
    or a CLI that sets `should_exit` itself)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _make_state(
    scripts: Any,
    ttft: Ttft | str | float | None,
    api_key: str | None,
    models: frozenset[str] | None,
    delta_delay_ms: float,
) -> ServerState:
    if ttft is None:
        ttft = Ttft()
    elif isinstance(ttft, int | float):
        ttft = Ttft("fixed", float(ttft))
    elif isinstance(ttft, str):
        ttft = Ttft.parse(ttft)
    return ServerState(as_book(scripts), ttft, api_key, models, delta_delay_ms)


def _server(state: ServerState, host: str, port: int) -> QuietServer:
    config = uvicorn.Config(
        build_app(state),
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        access_log=False,
    )
    return QuietServer(config)


def _bound_port(server: uvicorn.Server) -> int:
    return int(server.servers[0].sockets[0].getsockname()[1])


class ModelServer:
    """A running scripted model server; `base_url` goes to `AsyncAnthropic(base_url=...)`."""

    def __init__(self, state: ServerState, server: QuietServer, host: str) -> None:
        self.state = state
        self._server = server
        self.host = host
        self.port = _bound_port(server)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def rejections(self) -> list[dict[str, Any]]:
        """Requests refused so far (what `GET /_oma/rejections` returns)."""
        with self.state.lock:
            return list(self.state.rejections)

    def served(self) -> list[dict[str, Any]]:
        """Turns served so far (what `GET /_oma/served` returns)."""
        with self.state.lock:
            return list(self.state.served)


class AsyncModelServer(ModelServer):
    """Served by a task in the event loop that started it."""

    def __init__(
        self, state: ServerState, server: QuietServer, host: str, task: asyncio.Task[None]
    ) -> None:
        super().__init__(state, server, host)
        self._task = task

    async def stop(self) -> None:
        self._server.should_exit = True
        await self._task

    async def __aenter__(self) -> AsyncModelServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class ThreadedModelServer(ModelServer):
    """Served by its own event loop in a daemon thread; for synchronous callers."""

    def __init__(
        self, state: ServerState, server: QuietServer, host: str, thread: threading.Thread
    ) -> None:
        super().__init__(state, server, host)
        self._thread = thread

    def stop_sync(self) -> None:
        self._server.should_exit = True
        self._thread.join()

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_sync)

    def __enter__(self) -> ThreadedModelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_sync()


async def start_model_server(
    scripts: Any,
    *,
    ttft: Ttft | str | float | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    models: frozenset[str] | None = None,
    delta_delay_ms: float = 0.0,
) -> AsyncModelServer:
    """Start serving `scripts` in the running event loop; returns once it accepts connections.

    `scripts` is a path, a `ScriptBook`/`Script`, decoded script JSON, or a list of these
    (see `script.py`). `ttft` is a `Ttft`, a spec such as `"lognormal:50,0.5"`, or fixed
    milliseconds. `api_key`, when set, is the only key accepted; `models`, when set, the only
    model names (others get 404). Port 0 picks a free port: read `.base_url`.
    """
    state = _make_state(scripts, ttft, api_key, models, delta_delay_ms)
    await asyncio.to_thread(warm_up)
    server = _server(state, host, port)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError(f"model server failed to start on {host}:{port}")
        await asyncio.sleep(0.01)
    return AsyncModelServer(state, server, host, task)


def start_model_server_in_thread(
    scripts: Any,
    *,
    ttft: Ttft | str | float | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    models: frozenset[str] | None = None,
    delta_delay_ms: float = 0.0,
) -> ThreadedModelServer:
    """Like `start_model_server`, but served from a background thread (no event loop needed)."""
    state = _make_state(scripts, ttft, api_key, models, delta_delay_ms)
    warm_up()
    server = _server(state, host, port)
    failed: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=serve, name="oma-model-server", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"model server failed to start on {host}:{port}: {failed}")
        thread.join(0.01)
    return ThreadedModelServer(state, server, host, thread)


async def fetch_rejections(base_url: str) -> list[dict[str, Any]]:
    """`GET /_oma/rejections` of a model server running elsewhere (e.g. another process)."""
    async with httpx.AsyncClient(base_url=base_url) as client:
        response = await client.get("/_oma/rejections")
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()
        return result
