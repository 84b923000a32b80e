"""Assembling a harness server: channels to its peers, the driver, the gRPC service."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from oma.harness.v1 import harness_pb2_grpc
from oma.runtime.client import ClientTls, connect
from oma.runtime.server import RunningServer, ServerOptions, Service, start_server
from oma.servers.harness.driver import Driver, DriverConfig
from oma.servers.harness.grpc_ports import GrpcMcp, GrpcSandbox, GrpcSession, GrpcVault
from oma.servers.harness.model import make_client
from oma.servers.harness.service import SERVICE_NAME, HarnessServicer


@dataclass(frozen=True)
class HarnessConfig:
    """Where the harness's peers are and how it drives sessions.

    `token` is the harness-role bearer token it presents to the session and sandbox
    services. `model_base_url` points the `anthropic` SDK at another Messages API server
    (the scripted model server in tests and demos); empty means the real API, with
    `ANTHROPIC_API_KEY`.
    """

    session_address: str
    sandbox_address: str
    token: str
    vault_address: str = ""
    model_base_url: str = ""
    model_api_key: str = ""
    tls: ClientTls | None = None
    driver: DriverConfig = field(default_factory=DriverConfig)


@dataclass
class Harness:
    """A running harness server and what it owns; `stop()` closes everything."""

    server: RunningServer
    driver: Driver
    channels: list[grpc.aio.Channel]

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(grace)
        await self.driver.close()
        for channel in self.channels:
            await channel.close(None)


def build_driver(config: HarnessConfig) -> tuple[Driver, list[grpc.aio.Channel]]:
    session_channel = connect(config.session_address, token=config.token, tls=config.tls)
    sandbox_channel = connect(config.sandbox_address, token=config.token, tls=config.tls)
    channels: list[grpc.aio.Channel] = [session_channel, sandbox_channel]
    vault = None
    if config.vault_address:
        vault_channel = connect(config.vault_address, token=config.token, tls=config.tls)
        channels.append(vault_channel)
        vault = GrpcVault(vault_channel)
    model = make_client(config.model_base_url or None, config.model_api_key or None)
    driver = Driver(
        GrpcSession(session_channel),
        GrpcSandbox(sandbox_channel, vault),
        model,
        config.driver,
        mcp=GrpcMcp(vault),
    )
    return driver, channels


async def start_harness(config: HarnessConfig, options: ServerOptions) -> Harness:
    """Start a harness server (call inside the event loop that will run it)."""
    driver, channels = build_driver(config)
    service = Service(
        HarnessServicer(driver), harness_pb2_grpc.add_HarnessServiceServicer_to_server, SERVICE_NAME
    )
    server = await start_server([service], options)
    return Harness(server, driver, channels)
