"""Assembling a sandbox server: a backend, the manager around it, and the gRPC service."""

from __future__ import annotations

from pathlib import Path

from oma.runtime.server import RunningServer, ServerOptions, start_server
from oma.servers.sandbox.backends.base import Backend
from oma.servers.sandbox.git import RepositoryFetcher
from oma.servers.sandbox.manager import SandboxManager
from oma.servers.sandbox.model import Limits
from oma.servers.sandbox.servicer import sandbox_service


def make_backend(kind: str, root: Path, *, image: str | None = None) -> Backend:
    if kind == "docker":
        from oma.servers.sandbox.backends.docker import DEFAULT_IMAGE, DockerBackend

        return DockerBackend(root, default_image=image or DEFAULT_IMAGE)
    if kind == "local":
        from oma.servers.sandbox.backends.local import LocalBackend

        return LocalBackend(root)
    raise ValueError(f"unknown sandbox backend {kind!r}: use docker or local")


def build_manager(
    kind: str,
    root: Path,
    *,
    image: str | None = None,
    fetcher: RepositoryFetcher | None = None,
    limits: Limits | None = None,
    reaper_interval: float = 5.0,
) -> SandboxManager:
    return SandboxManager(
        make_backend(kind, root, image=image),
        limits=limits,
        fetcher=fetcher,
        reaper_interval=reaper_interval,
    )


async def start_sandbox_server(manager: SandboxManager, options: ServerOptions) -> RunningServer:
    """Recovers the backend's sandboxes, then serves; the caller stops the server and then
    `await manager.close()`."""
    await manager.start()
    return await start_server([sandbox_service(manager)], options)
