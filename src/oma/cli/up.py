"""`oma up`: the four OMA servers on this machine, with embedded defaults.

Session and vault keep their state in SQLite under the data directory (`$OMA_HOME`, default
`~/.oma`); the sandbox server uses Docker when an engine is reachable and has the sandbox
image, else bubblewrap. Ctrl-C or SIGTERM stops every server cleanly.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=["auto", "docker", "local"],
        default="auto",
        help="sandbox backend (default auto: Docker if usable, else bubblewrap)",
    )
    parser.add_argument(
        "--model-base-url",
        default="",
        metavar="URL",
        help="Messages API base URL for the harness, e.g. an `oma model-server` "
        "(default: the real API with ANTHROPIC_API_KEY)",
    )
    parser.add_argument(
        "--random-ports", action="store_true", help="pick free ports instead of 50051-50054"
    )


def run(args: argparse.Namespace) -> int:
    import signal
    import time

    from oma.cli._stack import running_stack, start_stack
    from oma.runtime.paths import data_dir

    home = data_dir()
    existing = running_stack(home)
    if existing is not None:
        print(
            f"oma up is already running (pid {existing.pid}); its harness is at {existing.harness}"
        )
        return 1
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        stack = start_stack(
            home,
            backend=args.backend,
            fixed_ports=not args.random_ports,
            model_base_url=args.model_base_url,
        )
    except (RuntimeError, OSError) as error:
        print(f"oma up: {error}")
        return 1
    i = stack.info
    print(
        f"session  {i.session}\nsandbox  {i.sandbox}  ({i.sandbox_backend})\n"
        f"vault    {i.vault}\nharness  {i.harness}\n"
        f"tokens   {i.tokens_file}\nlogs     {home / 'logs'}\n"
        f'Ready. Try: oma run "write a haiku to a file and read it back"  (Ctrl-C stops)',
        flush=True,
    )
    code = 0
    while not stopping:
        dead = stack.dead()
        if dead:
            print(f"oma up: {', '.join(dead)} exited; stopping (see {home / 'logs'})")
            code = 1
            break
        time.sleep(0.2)
    print("stopping…", flush=True)
    stack.stop()
    print("stopped", flush=True)
    return code
