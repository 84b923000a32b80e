"""Assemble a session server: open the database, start the hub, serve the servicer.

`SessionServer.start(db_url, options)` is what the CLI, the tests and the benchmark use.
"""

from __future__ import annotations

from dataclasses import dataclass

from oma.runtime.server import RunningServer, ServerOptions, Service, start_server
from oma.servers.session.database import open_database
from oma.servers.session.events import Limits
from oma.servers.session.hub import Hub
from oma.servers.session.servicer import SERVICE_NAME, SessionServicer
from oma.servers.session.store import SessionStore
from oma.session.v1 import session_service_pb2_grpc


@dataclass
class SessionServer:
    store: SessionStore
    hub: Hub
    running: RunningServer

    @property
    def address(self) -> str:
        return self.running.address

    @classmethod
    async def start(
        cls, db_url: str, options: ServerOptions, limits: Limits | None = None
    ) -> SessionServer:
        db = await open_database(db_url)
        store = SessionStore(db, limits)
        hub = Hub(store)
        try:
            await hub.start()
            servicer = SessionServicer(store, hub)
            running = await start_server(
                [
                    Service(
                        servicer,
                        session_service_pb2_grpc.add_SessionServiceServicer_to_server,
                        SERVICE_NAME,
                    )
                ],
                options,
            )
        except BaseException:
            await hub.close()
            await db.close()
            raise
        return cls(store, hub, running)

    async def stop(self, grace: float | None = None) -> None:
        try:
            await self.running.stop(grace)
        finally:
            await self.hub.close()
            await self.store.db.close()
