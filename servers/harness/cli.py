"""`oma serve harness`: the stateless harness server."""

from __future__ import annotations

import argparse
import os

DEFAULT_LISTEN = "127.0.0.1:50054"


def configure(parser: argparse.ArgumentParser) -> None:
    from oma.runtime.cli import add_server_arguments

    add_server_arguments(parser, default_listen=DEFAULT_LISTEN)
    peers = parser.add_argument_group("peers")
    peers.add_argument(
        "--session", required=True, metavar="ADDRESS", help="address of the session service"
    )
    peers.add_argument(
        "--sandbox", required=True, metavar="ADDRESS", help="address of the sandbox service"
    )
    peers.add_argument(
        "--vault",
        default="",
        metavar="ADDRESS",
        help="address of the vault (needed only by sessions that use credentials)",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model-base-url",
        default=os.environ.get("OMA_MODEL_BASE_URL", ""),
        metavar="URL",
        help="Messages API base URL, e.g. a scripted `oma model-server` "
        "(default $OMA_MODEL_BASE_URL, else the real API with ANTHROPIC_API_KEY)",
    )
    model.add_argument(
        "--max-model-retries",
        type=int,
        default=3,
        metavar="N",
        help="retries of a failing model request before the session idles "
        "with retries_exhausted (default 3)",
    )
    model.add_argument(
        "--lease-ttl-seconds",
        type=float,
        default=30.0,
        metavar="S",
        help="session lease lifetime; renewed every third of it (default 30)",
    )
    context = parser.add_argument_group(
        "context",
        "What each model request holds once a conversation outgrows the model's context "
        "(the log itself is never trimmed): the task, a note of what is left out, and the "
        "most recent events, in a window that moves in coarse steps so that the prompt "
        "cache keeps hitting (HARNESS-CONTEXT-001).",
    )
    context.add_argument(
        "--context-budget-tokens",
        type=int,
        default=150_000,
        metavar="N",
        help="estimated prompt tokens (system, tools, messages) a request may hold; leave "
        "room for the reply below the model's context size (default 150000)",
    )
    context.add_argument(
        "--context-step-events",
        type=int,
        default=32,
        metavar="N",
        help="the window's start moves in steps of this many log events; larger steps keep "
        "the cache hitting longer but send fewer events after a move (default 32)",
    )
    worker = parser.add_argument_group(
        "worker mode",
        "With --worker the harness also takes sessions by itself: the session service pushes "
        "each session that has unanswered input and no live lease (WatchPendingSessions), "
        "workers race for its lease, and the winner drives it. On SIGTERM a worker stops "
        "taking sessions, appends session.status_rescheduled to each one it drives, releases "
        "their leases (another worker picks them up at once) and exits 0; a worker that is "
        "killed loses its sessions to the others when their leases expire "
        "(--lease-ttl-seconds). Wake keeps working on --listen: give each worker on one "
        "machine its own address (port 0 picks a free one).",
    )
    worker.add_argument(
        "--worker",
        action="store_true",
        help="claim pending sessions pushed by the session service",
    )
    worker.add_argument(
        "--max-sessions",
        type=int,
        default=16,
        metavar="N",
        help="sessions a worker drives at once; more wait for a free slot or another "
        "worker (default 16)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from oma.runtime.cli import announce, server_options_from_args
    from oma.runtime.server import run_until_signal
    from oma.servers.harness import faults
    from oma.servers.harness.app import HarnessConfig, start_harness
    from oma.servers.harness.context import SlidingWindowPolicy
    from oma.servers.harness.driver import DriverConfig
    from oma.servers.harness.loop import LoopConfig

    logging.basicConfig(
        level=os.environ.get("OMA_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.max_model_retries < 0:
        raise SystemExit("--max-model-retries must be >= 0")
    if args.lease_ttl_seconds <= 0:
        raise SystemExit("--lease-ttl-seconds must be > 0")
    if args.max_sessions < 1:
        raise SystemExit("--max-sessions must be >= 1")
    if args.context_budget_tokens < 1 or args.context_step_events < 1:
        raise SystemExit("--context-budget-tokens and --context-step-events must be >= 1")
    options = server_options_from_args(args)
    try:
        faults.validate()
    except ValueError as error:
        raise SystemExit(str(error)) from None
    config = HarnessConfig(
        session_address=args.session,
        sandbox_address=args.sandbox,
        vault_address=args.vault,
        token=options.tokens.token_for("harness"),
        model_base_url=args.model_base_url,
        driver=DriverConfig(
            lease_ttl_seconds=args.lease_ttl_seconds,
            loop=LoopConfig(
                max_model_retries=args.max_model_retries,
                context=SlidingWindowPolicy(
                    budget_tokens=args.context_budget_tokens,
                    step_events=args.context_step_events,
                ),
            ),
        ),
    )

    async def main() -> int:
        try:
            harness = await start_harness(config, options)
        except OSError as exc:
            print(f"oma harness: {exc}")
            return 1
        announce("harness", harness.server)
        if args.worker:
            from oma.servers.harness.worker import WorkerConfig
            from oma.servers.harness.worker_grpc import serve_worker

            return await serve_worker(harness, config, WorkerConfig(args.max_sessions))
        try:
            await run_until_signal(harness.server)
        finally:
            await harness.driver.close()
            for channel in harness.channels:
                await channel.close(None)
        return 0

    return asyncio.run(main())
