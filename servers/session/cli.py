"""`oma serve session --listen ADDR --db URL`: the session log server."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 50051


def configure(parser: argparse.ArgumentParser) -> None:
    from oma.runtime.cli import add_server_arguments

    add_server_arguments(parser, default_listen=f"127.0.0.1:{DEFAULT_PORT}")
    parser.add_argument(
        "--db",
        metavar="URL",
        default=None,
        help="sqlite:///path/file.db (default: sessions.db in $OMA_HOME or ~/.oma) or "
        "postgresql://user:password@host:port/database",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from oma.runtime.cli import announce, server_options_from_args
    from oma.runtime.paths import data_dir
    from oma.runtime.server import run_until_signal
    from oma.servers.session.database import DatabaseInUse, DurabilityError
    from oma.servers.session.server import SessionServer

    options = server_options_from_args(args)
    db_url = args.db or f"sqlite:///{data_dir() / 'sessions.db'}"

    async def main() -> int:
        try:
            server = await SessionServer.start(db_url, options)
        except (DurabilityError, DatabaseInUse) as exc:
            print(f"oma session: refusing to start: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"oma session: {exc}", file=sys.stderr)
            return 1
        announce("session", server.running)
        try:
            await run_until_signal(server.running)
        finally:
            await server.stop()
        return 0

    return asyncio.run(main())
