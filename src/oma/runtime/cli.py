"""Command-line plumbing shared by every `oma serve <service>` command.

`add_server_arguments(parser, default_listen=...)` adds `--listen`, `--tls-cert`, `--tls-key`,
`--tls-client-ca`, `--tokens`, `--grace-seconds` and `--max-message-bytes`;
`server_options_from_args(args)` turns them into `ServerOptions` (loading the token file,
creating the default one with fresh tokens when missing). `announce(service, running)` prints
the one line a wrapper script or test waits for: `oma <service> serving on ADDRESS`.
`serve(service, services, options)` does start → announce → run until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oma.runtime.server import RunningServer, ServerOptions, Service

DEFAULT_GRACE_SECONDS = 10.0
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def add_server_arguments(
    parser: argparse.ArgumentParser, default_listen: str = "127.0.0.1:0"
) -> None:
    """Add the flags every OMA server takes. Pass the service's own `default_listen`
    (e.g. `127.0.0.1:7401`): a CLI on a random port is hard to find."""
    group = parser.add_argument_group("server")
    group.add_argument(
        "--listen",
        default=default_listen,
        metavar="ADDRESS",
        help=f"host:port (port 0 picks one) or unix:/path to listen on (default {default_listen})",
    )
    group.add_argument(
        "--tls-cert", type=Path, metavar="PEM", help="server certificate (enables TLS)"
    )
    group.add_argument("--tls-key", type=Path, metavar="PEM", help="server private key")
    group.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="PEM",
        help="require client certificates signed by this CA (mTLS)",
    )
    group.add_argument(
        "--tokens",
        type=Path,
        metavar="PATH",
        help="JSON file of role → bearer token (default: $OMA_HOME/tokens.json, "
        "created with fresh tokens when missing)",
    )
    group.add_argument(
        "--grace-seconds",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        metavar="S",
        help="on SIGTERM, time given to unary calls in flight before open streams are ended "
        f"(default {DEFAULT_GRACE_SECONDS:g})",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        metavar="N",
        help=f"largest message sent or received (default {DEFAULT_MAX_MESSAGE_BYTES})",
    )


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    """`ServerOptions` from the flags; raises SystemExit with a readable message on a bad
    combination (key without cert, unreadable token file)."""
    from oma.runtime.auth import TokenTable
    from oma.runtime.paths import ensure_tokens_file
    from oma.runtime.server import ServerOptions, ServerTls

    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("--tls-cert and --tls-key must be given together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS first)")
    for flag, path in (
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--tls-client-ca", args.tls_client_ca),
    ):
        if path is not None and not path.is_file():
            raise SystemExit(f"{flag} {path}: no such file")
    tls = (
        ServerTls(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)
        if args.tls_cert is not None
        else None
    )
    tokens_path = args.tokens if args.tokens is not None else ensure_tokens_file()
    try:
        tokens = TokenTable.load(tokens_path)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.grace_seconds < 0:
        raise SystemExit("--grace-seconds must be >= 0")
    if args.max_message_bytes <= 0:
        raise SystemExit("--max-message-bytes must be > 0")
    return ServerOptions(
        tokens=tokens,
        listen=args.listen,
        tls=tls,
        grace_seconds=args.grace_seconds,
        max_message_bytes=args.max_message_bytes,
    )


def announce(service: str, running: RunningServer) -> None:
    """Print `oma <service> serving on ADDRESS` (flushed: scripts wait for this line)."""
    print(f"oma {service} serving on {running.address}", flush=True)


async def serve(service: str, services: Sequence[Service], options: ServerOptions) -> int:
    """Start the server, announce it, serve until SIGTERM/SIGINT, stop gracefully."""
    from oma.runtime.server import run_until_signal, start_server

    try:
        running = await start_server(services, options)
    except OSError as exc:
        print(f"oma {service}: {exc}", file=sys.stderr)
        return 1
    announce(service, running)
    await run_until_signal(running)
    return 0
