"""The `oma` command line.

Every command lives in its own module, named in `COMMANDS` below. A command module exposes

    def configure(parser: argparse.ArgumentParser) -> None   # add its arguments
    def run(args: argparse.Namespace) -> int                  # do the work, return exit code

and keeps heavy imports (grpc, sqlalchemy, docker, ...) inside `run`, so that `oma --help`
stays fast and works even when an optional engine is missing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from oma import __version__


@dataclass(frozen=True)
class Command:
    """One leaf command: its words after `oma`, the module implementing it, its summary."""

    words: tuple[str, ...]
    module: str
    summary: str


# Group words (the non-leaf levels) and what they are for.
GROUPS: dict[tuple[str, ...], str] = {
    ("serve",): "run one reference server (session, sandbox, vault, harness)",
    ("bench",): "benchmarks that reproduce the architecture's headline numbers",
    ("sandbox",): "sandbox tooling (build the local sandbox image)",
}

COMMANDS: list[Command] = [
    Command(("serve", "session"), "oma.servers.session.cli",
            "the durable, append-only session log (SQLite or PostgreSQL)"),
    Command(("serve", "sandbox"), "oma.servers.sandbox.cli",
            "the sandbox service: where tools run (Docker or bubblewrap)"),
    Command(("serve", "vault"), "oma.servers.vault.cli",
            "the credential vault and its injecting HTTP proxy"),
    Command(("serve", "harness"), "oma.servers.harness.cli",
            "the stateless harness that drives sessions with a model"),
    Command(("sandbox", "build-image"), "oma.servers.sandbox.image_cli",
            "build (and cache) the sandbox image locally from Debian packages"),
    Command(("model-server",), "oma.servers.harness.model_server.cli",
            "a scripted Anthropic Messages API server for tests, demos and benchmarks"),
    Command(("up",), "oma.cli.up", "start all four servers with embedded defaults"),
    Command(("run",), "oma.cli.run", "create a session with a prompt and watch it live"),
    Command(("demo",), "oma.cli.demo",
            "run a whole scripted agent session end to end (no API key, no network)"),
    Command(("conformance",), "oma.conformance.cli",
            "check any OMA server against the contract's requirements (JUnit/JSON reports)"),
    Command(("bench", "session"), "oma.bench.session",
            "session log: append, tail-read and stream latency ratios"),
    Command(("bench", "sandbox"), "oma.bench.sandbox",
            "sandbox: exec and provision latency ratios against raw Docker"),
]


def _available(command: Command) -> bool:
    try:
        return importlib.util.find_spec(command.module) is not None
    except ModuleNotFoundError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oma",
        description="OMA — Open Managed Agents. Durable sessions, stateless harnesses, "
        "sandboxed tools and a credential vault, all behind versioned gRPC contracts.",
    )
    parser.add_argument("--version", action="version", version=f"oma {__version__}")
    subparsers_by_prefix: dict[tuple[str, ...], argparse._SubParsersAction] = {
        (): parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    }
    for command in COMMANDS:
        if not _available(command):
            continue
        for depth in range(1, len(command.words)):
            prefix = command.words[:depth]
            if prefix not in subparsers_by_prefix:
                group_help = GROUPS.get(prefix, "")
                group = subparsers_by_prefix[prefix[:-1]].add_parser(
                    prefix[-1], help=group_help, description=group_help)
                subparsers_by_prefix[prefix] = group.add_subparsers(
                    dest="_".join(prefix), metavar="SUBCOMMAND", required=True)
        leaf = subparsers_by_prefix[command.words[:-1]].add_parser(
            command.words[-1], help=command.summary, description=command.summary)
        module = importlib.import_module(command.module)
        module.configure(leaf)
        leaf.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
