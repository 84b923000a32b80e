"""The implementation under test: addresses of its services and the tokens to call them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

import grpc

SERVICES = ("session", "sandbox", "vault", "harness")


@dataclass
class Target:
    """Where each service of the target listens, and one bearer token per role
    (`client`, `harness`, `sandbox_server`, `admin`)."""

    addresses: dict[str, str]
    tokens: dict[str, str]
    _channels: dict[tuple[str, str], grpc.aio.Channel] = field(default_factory=dict)
    _capabilities: dict[str, Any] = field(default_factory=dict)

    def channel(self, service: str, role: str = "admin") -> grpc.aio.Channel:
        """A channel to `service` authenticated as `role` (an empty role sends no token)."""
        from oma.runtime.client import connect

        key = (service, role)
        if key not in self._channels:
            token = self.tokens.get(role) if role else None
            self._channels[key] = connect(self.addresses[service], token=token)
        return self._channels[key]

    def stub(self, service: str, role: str = "admin") -> Any:
        """The generated stub of `service`, e.g. `SessionServiceStub`, on a `role` channel."""
        module = _grpc_module(service)
        return getattr(module, f"{service.capitalize()}ServiceStub")(self.channel(service, role))

    async def features(self, service: str) -> set[str]:
        if service not in self._capabilities:
            module = _pb2_module(service)
            response = await self.stub(service).GetCapabilities(module.GetCapabilitiesRequest())
            self._capabilities[service] = response.server_info
        return set(self._capabilities[service].features)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()


@cache  # every stub() call asks; the import probing need happen once per service
def _service_file(service: str) -> str:
    import importlib

    for name in (f"{service}_service", service):
        try:
            importlib.import_module(f"oma.{service}.v1.{name}_pb2")
            return name
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"no generated stubs for oma.{service}.v1")


def _pb2_module(service: str) -> Any:
    import importlib

    return importlib.import_module(f"oma.{service}.v1.{_service_file(service)}_pb2")


def _grpc_module(service: str) -> Any:
    import importlib

    return importlib.import_module(f"oma.{service}.v1.{_service_file(service)}_pb2_grpc")
