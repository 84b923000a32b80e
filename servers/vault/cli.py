"""`oma serve vault`: the credential vault and its injecting HTTP proxy.

    oma serve vault [--listen 127.0.0.1:50053] [--db URL] [--key-file PATH] [--session ADDR]

Defaults keep everything in the data directory (`$OMA_HOME`, else `~/.oma`): the SQLite
database `vault.db` and the master key file `vault.key` (created 0600 on first start),
unless `OMA_VAULT_MASTER_KEY` (base64 of 32 bytes) provides the key. Rotate a key-file master
key while serving with the admin RPC `RotateMasterKey` (e.g. `grpcurl ... RotateMasterKey`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:50053"


def configure(parser: argparse.ArgumentParser) -> None:
    from oma.runtime.cli import add_server_arguments

    add_server_arguments(parser, default_listen=DEFAULT_LISTEN)
    group = parser.add_argument_group("vault")
    group.add_argument(
        "--db",
        metavar="URL",
        help="SQLAlchemy URL (sqlite:///path or postgresql://...); default $OMA_HOME/vault.db",
    )
    group.add_argument(
        "--key-file",
        type=Path,
        metavar="PATH",
        help="master key file (default $OMA_HOME/vault.key, created 0600); "
        "ignored when OMA_VAULT_MASTER_KEY is set",
    )
    group.add_argument(
        "--session",
        metavar="ADDRESS",
        help="session service address; lets harnesses issue session tokens "
        "for credentials their session's definition lists",
    )


def default_db_url() -> str:
    from oma.runtime.paths import data_dir

    return f"sqlite+aiosqlite:///{data_dir() / 'vault.db'}"


def default_key_file() -> Path:
    from oma.runtime.paths import data_dir

    return data_dir() / "vault.key"


async def build_vault(db_url: str, key_file: Path) -> object:
    from oma.servers.vault.core import Vault
    from oma.servers.vault.crypto import Keyring
    from oma.servers.vault.store import VaultStore

    store = VaultStore(db_url)
    await store.initialize()
    return Vault(store, Keyring.load(key_file))


async def _finish_rotation(vault: object) -> None:
    import logging

    from oma.servers.vault.core import Vault

    assert isinstance(vault, Vault)
    count, unreadable = await vault.reencrypt_stale()
    log = logging.getLogger("oma.vault")
    if count:
        log.warning("re-encrypted %d secrets under the current master key", count)
    if unreadable:
        log.error("credentials under a master key this vault does not hold: %s", unreadable)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from oma.runtime.cli import serve, server_options_from_args
    from oma.runtime.paths import data_dir
    from oma.runtime.server import Service
    from oma.servers.vault.core import Vault
    from oma.servers.vault.crypto import MasterKeyError
    from oma.servers.vault.service import SERVICE_NAME, VaultServicer
    from oma.servers.vault.sessions import session_lookup_factory
    from oma.vault.v1 import vault_pb2_grpc

    options = server_options_from_args(args)
    if args.db is None:
        data_dir().mkdir(parents=True, exist_ok=True, mode=0o700)

    async def main() -> int:
        try:
            vault = await build_vault(
                args.db or default_db_url(), args.key_file or default_key_file()
            )
        except MasterKeyError as exc:
            print(f"oma vault: {exc}")
            return 1
        assert isinstance(vault, Vault)
        # Finishes an interrupted rotation, or a restart with a new environment key, while
        # already serving.
        background = asyncio.create_task(_finish_rotation(vault))
        lookup = session_lookup_factory(args.session) if args.session else None
        service = Service(
            VaultServicer(vault, lookup),
            vault_pb2_grpc.add_VaultServiceServicer_to_server,
            SERVICE_NAME,
        )
        try:
            return await serve("vault", [service], options)
        finally:
            background.cancel()
            await vault.close()

    return asyncio.run(main())
