"""A real vault gRPC server for tests (SQLite in a temp dir by default), and its stubs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class VaultUnderTest:
    address: str
    tokens: Any
    vault: Any
    channels: dict[str, Any]
    running: Any
    key_file: Path
    db_url: str

    def stub(self, role: str = "admin") -> Any:
        from oma.runtime.client import connect
        from oma.vault.v1 import vault_pb2_grpc

        if role not in self.channels:
            token = self.tokens.token_for(role) if role != "none" else None
            self.channels[role] = connect(self.address, token=token)
        return vault_pb2_grpc.VaultServiceStub(self.channels[role])


async def start_vault(
    tmp_path: Path,
    db_url: str | None = None,
    session_address: str | None = None,
    *,
    key_file: Path | None = None,
    tokens: Any = None,
    **limits: Any,
) -> VaultUnderTest:
    from oma.runtime.auth import TokenTable
    from oma.runtime.server import ServerOptions, Service, start_server
    from oma.servers.vault.core import Vault, VaultLimits
    from oma.servers.vault.crypto import Keyring
    from oma.servers.vault.service import SERVICE_NAME, VaultServicer
    from oma.servers.vault.sessions import session_lookup_factory
    from oma.servers.vault.store import VaultStore
    from oma.vault.v1 import vault_pb2_grpc

    url = db_url or f"sqlite+aiosqlite:///{tmp_path / 'vault.db'}"
    store = VaultStore(url)
    await store.initialize()
    key_file = key_file or tmp_path / "vault.key"
    vault = Vault(store, Keyring.load(key_file, environ={}), VaultLimits(**limits))
    tokens = tokens or TokenTable.generate()
    lookup = session_lookup_factory(session_address) if session_address else None
    running = await start_server(
        [
            Service(
                VaultServicer(vault, lookup),
                vault_pb2_grpc.add_VaultServiceServicer_to_server,
                SERVICE_NAME,
            )
        ],
        ServerOptions(tokens=tokens, listen="127.0.0.1:0"),
    )
    return VaultUnderTest(running.address, tokens, vault, {}, running, key_file, url)


async def stop_vault(v: VaultUnderTest) -> None:
    for channel in v.channels.values():
        await channel.close()
    await v.running.stop(0)
    await v.vault.close()
