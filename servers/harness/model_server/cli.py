"""`oma model-server`: serve scripted turns over the Anthropic Messages API.

    oma model-server --script demo.json --listen 127.0.0.1:8765 --ttft lognormal:50,0.5

then point any client at it, e.g. `ANTHROPIC_BASE_URL=http://127.0.0.1:8765`.
"""

from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--script",
        action="append",
        metavar="FILE",
        help="script file (JSON; YAML with PyYAML); repeat to serve several. "
        "Default: the bundled demo script",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:8765",
        metavar="HOST:PORT",
        help="address to listen on (port 0 picks a free one); default %(default)s",
    )
    parser.add_argument(
        "--ttft",
        metavar="SPEC",
        help="time to first token: fixed:MS, uniform:LOW,HIGH or lognormal:MEDIAN,SIGMA",
    )
    parser.add_argument(
        "--ttft-ms",
        type=float,
        metavar="MS",
        help="fixed time to first token in milliseconds (shorthand for --ttft fixed:MS)",
    )
    parser.add_argument(
        "--seed", type=int, help="seed for the TTFT distribution (reproducible draws)"
    )
    parser.add_argument(
        "--delta-delay-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="pause between streamed deltas (default 0)",
    )
    parser.add_argument("--api-key", help="accept only this API key (default: any non-empty key)")
    parser.add_argument(
        "--model",
        action="append",
        metavar="NAME",
        help="accept only these model names (others get 404); repeatable",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    import uvicorn

    from oma.servers.harness.model_server import DEMO_SCRIPT
    from oma.servers.harness.model_server.app import ServerState, build_app
    from oma.servers.harness.model_server.script import ScriptError, as_book
    from oma.servers.harness.model_server.server import QuietServer
    from oma.servers.harness.model_server.ttft import Ttft
    from oma.servers.harness.model_server.validate import warm_up

    try:
        book = as_book(args.script or [str(DEMO_SCRIPT)])
        if args.ttft and args.ttft_ms is not None:
            raise ValueError("give either --ttft or --ttft-ms, not both")
        spec = args.ttft or (f"fixed:{args.ttft_ms}" if args.ttft_ms is not None else "fixed:0")
        ttft = Ttft.parse(spec, seed=args.seed)
        host, sep, port_text = args.listen.rpartition(":")
        if not sep or not port_text.isdigit():
            raise ValueError(f"--listen {args.listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8765")
    except (ScriptError, ValueError, OSError) as exc:
        print(f"oma model-server: {exc}", file=sys.stderr)
        return 2
    host = host.strip("[]") or "127.0.0.1"
    models = frozenset(args.model) if args.model else None
    state = ServerState(book, ttft, args.api_key, models, args.delta_delay_ms)
    warm_up()
    server = QuietServer(
        uvicorn.Config(
            build_app(state),
            host=host,
            port=int(port_text),
            log_level="warning",
            lifespan="off",
            access_log=False,
        )
    )

    async def serve() -> None:
        # SIGTERM/SIGINT finish in-flight replies, then exit 0 (uvicorn's own handlers would
        # re-raise the signal and end the process with -15).
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, setattr, server, "should_exit", True)
        task = asyncio.create_task(server.serve())
        # uvicorn offers no startup event to await, only the `started` flag.
        while True:
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            names = ", ".join(
                f"{n}{' (default)' if n == book.default else ''}" for n in book.scripts
            )
            print(
                f"model server listening on http://{host}:{port} (scripts: {names}; ttft {ttft})",
                flush=True,
            )
        await task

    try:
        asyncio.run(serve())
    except SystemExit as exc:  # uvicorn exits when it cannot bind
        return int(exc.code or 1)
    return 0 if server.started else 1
