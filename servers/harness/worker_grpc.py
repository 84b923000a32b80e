"""Worker mode over gRPC: the `WatchPendingSessions` feed, and serving until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import grpc

from oma.runtime.client import connect
from oma.servers.harness.app import Harness, HarnessConfig
from oma.servers.harness.ports import Unreachable
from oma.servers.harness.worker import Pending, Worker, WorkerConfig
from oma.session.v1 import session_service_pb2, session_service_pb2_grpc

log = logging.getLogger(__name__)


class GrpcPendingFeed:
    """`PendingFeed` over `SessionService.WatchPendingSessions`."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = session_service_pb2_grpc.SessionServiceStub(channel)

    async def watch(self) -> AsyncIterator[Pending]:
        call = self._stub.WatchPendingSessions(session_service_pb2.WatchPendingSessionsRequest())
        try:
            async for item in call:
                yield Pending(item.session_id, item.last_seq)
        except grpc.aio.AioRpcError as error:
            raise Unreachable(f"{error.code().name}: {error.details()}") from error
        finally:
            call.cancel()


def start_worker(harness: Harness, config: HarnessConfig, worker: WorkerConfig) -> RunningWorker:
    """Start a worker on a running harness's driver, with its own channel for the stream."""
    channel = connect(config.session_address, token=config.token, tls=config.tls)
    running = RunningWorker(Worker(harness.driver, GrpcPendingFeed(channel), worker), channel)
    running.worker.start()
    return running


class RunningWorker:
    def __init__(self, worker: Worker, channel: grpc.aio.Channel) -> None:
        self.worker = worker
        self.channel = channel

    async def stop(self, harness: Harness) -> None:
        """Stop taking sessions, hand the running ones back, stop the server, close up."""
        await self.worker.stop()
        log.info("handing %d session(s) back", self.worker.driving)
        await asyncio.gather(harness.driver.close(), harness.server.stop())
        await self.channel.close(None)
        for channel in harness.channels:
            await channel.close(None)


async def serve_worker(harness: Harness, config: HarnessConfig, worker: WorkerConfig) -> int:
    """Run worker mode until SIGTERM/SIGINT; the `Wake` server keeps serving meanwhile.

    On the first signal the worker stops taking sessions at once and gives the ones it drives
    back (`session.status_rescheduled`, lease released) while the server drains its calls; a
    second signal cuts the server's grace short.
    """
    running = start_worker(harness, config, worker)
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()

    def on_signal() -> None:
        if signalled.is_set():
            harness.server.hurry()
        signalled.set()

    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    try:
        terminated = asyncio.ensure_future(harness.server.wait_for_termination())
        waiting = asyncio.ensure_future(signalled.wait())
        await asyncio.wait({terminated, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        log.info("stopping: no new sessions")
        await running.stop(harness)
        terminated.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await terminated
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return 0
