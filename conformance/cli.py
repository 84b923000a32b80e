"""`oma conformance`: run the suite against any address."""

from __future__ import annotations

import argparse
from pathlib import Path

SERVICES = ("session", "sandbox", "vault", "harness")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Check OMA servers against the contract's requirements. Give the address of each "
        "service to check; MUST failures make the exit code 1, SHOULD failures are reported, "
        "and checks needing an optional feature run only when GetCapabilities advertises it.")
    for service in SERVICES:
        parser.add_argument(f"--{service}", metavar="ADDR", help=f"address of the {service} service")
    parser.add_argument("--tokens", type=Path,
                        help='JSON file mapping role to bearer token: {"client": ..., '
                             '"harness": ..., "sandbox_server": ..., "admin": ...}')
    parser.add_argument("-k", dest="name_filter", default="",
                        help="run only checks whose name contains this text")
    parser.add_argument("--junit", type=Path, help="write a JUnit XML report here")
    parser.add_argument("--json", type=Path, help="write a per-requirement JSON report here")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per check")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json

    from oma.conformance import checks  # noqa: F401
    from oma.conformance.registry import REGISTRY
    from oma.conformance.report import console, write_json, write_junit
    from oma.conformance.runner import Result, run_suite
    from oma.conformance.target import Target

    if args.list:
        for c in sorted(REGISTRY.values(), key=lambda c: c.name):
            print(f"{c.level.value:<6} {c.name}  [{', '.join(c.requirement_ids)}]")
        return 0
    addresses = {s: getattr(args, s) for s in SERVICES if getattr(args, s)}
    if not addresses:
        print("oma conformance: give at least one service address, e.g. --session 127.0.0.1:50051")
        return 2
    if args.tokens is None:
        print("oma conformance: --tokens FILE is required to call the target")
        return 2
    tokens = json.loads(args.tokens.read_text())

    async def go() -> list[Result]:
        target = Target(addresses, tokens)
        try:
            return await run_suite(target, list(addresses), name_filter=args.name_filter,
                                   seconds_per_check=args.timeout)
        finally:
            await target.close()

    results = asyncio.run(go())
    print(console(results))
    if args.junit:
        write_junit(results, args.junit)
    if args.json:
        write_json(results, args.json)
    return 1 if any(r.blocks_run for r in results) or not results else 0
