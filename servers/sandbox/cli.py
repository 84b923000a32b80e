"""`oma serve sandbox`: the sandbox service on Docker (default) or bubblewrap (`--backend local`)."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_LISTEN = "127.0.0.1:50052"


def configure(parser: argparse.ArgumentParser) -> None:
    from oma.runtime.cli import add_server_arguments

    add_server_arguments(parser, default_listen=DEFAULT_LISTEN)
    group = parser.add_argument_group("sandbox")
    group.add_argument(
        "--backend",
        choices=("docker", "local"),
        default="docker",
        help="docker: hardened containers (default); local: bubblewrap jails on this host",
    )
    group.add_argument(
        "--image",
        default=None,
        help="default image of the docker backend (default oma-sandbox:latest)",
    )
    group.add_argument(
        "--root",
        type=Path,
        default=None,
        help="directory for sandbox workspaces and executor sockets "
        "(default $OMA_HOME/sandboxes/<backend>)",
    )
    group.add_argument(
        "--vault",
        default=None,
        metavar="ADDRESS",
        help="vault service used to clone repositories that need a credential",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import sys

    from oma.runtime.cli import serve, server_options_from_args
    from oma.runtime.paths import data_dir
    from oma.servers.sandbox.server import build_manager
    from oma.servers.sandbox.servicer import sandbox_service

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    options = server_options_from_args(args)
    root = args.root or data_dir() / "sandboxes" / args.backend
    fetcher = None
    if args.vault:
        from oma.servers.vault.fetcher import VaultRepositoryFetcher

        fetcher = VaultRepositoryFetcher(args.vault, options.tokens.token_for("sandbox_server"))

    async def main() -> int:
        try:
            manager = build_manager(args.backend, root, image=args.image, fetcher=fetcher)
        except RuntimeError as error:  # engine missing, root already in use
            print(f"oma serve sandbox: {error}", file=sys.stderr)
            return 1
        await manager.start()
        try:
            return await serve("sandbox", [sandbox_service(manager)], options)
        finally:
            await manager.close()

    return asyncio.run(main())
