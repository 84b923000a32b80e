"""`oma demo`: a whole agent session end to end, with no API key and no network.

It starts the four servers (embedded defaults, free ports, state in the data directory) and
the scripted model server playing `model_server/examples/demo.json`: the model writes a
program in the sandbox, runs it, reads the output and answers. Exit status 0 means the
session went idle with `end_turn` after using its tools.
"""

from __future__ import annotations

import argparse

PROMPT = (
    "Write a small Python program that lists the prime numbers below 50, run it in "
    "the sandbox, and tell me what it printed."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=["auto", "docker", "local"],
        default="auto",
        help="sandbox backend (default auto: Docker if usable, else bubblewrap)",
    )
    parser.add_argument(
        "--ttft-ms",
        type=float,
        default=150.0,
        help="the scripted model's time to first token (default 150)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys
    from importlib import resources

    from oma.cli._render import Renderer
    from oma.cli._session import TurnFailed, run_prompt
    from oma.cli._stack import start_stack
    from oma.runtime.paths import data_dir
    from oma.servers.harness.model_server.server import start_model_server

    script = resources.files("oma.servers.harness.model_server") / "examples" / "demo.json"
    renderer = Renderer()

    async def main() -> int:
        async with await start_model_server(
            str(script), ttft=args.ttft_ms, delta_delay_ms=15
        ) as model:
            print(
                renderer.s.dim(
                    f"starting session, sandbox, vault and harness "
                    f"(scripted model at {model.base_url})…"
                ),
                flush=True,
            )
            stack = await asyncio.to_thread(
                start_stack,
                data_dir(),
                backend=args.backend,
                fixed_ports=False,
                model_base_url=model.base_url,
                record=False,
                grace_seconds=2,
            )
            print(renderer.s.dim(f"sandbox backend: {stack.info.sandbox_backend}"), flush=True)
            try:
                await run_prompt(
                    stack.info,
                    PROMPT,
                    model="claude-sonnet-4-6",
                    system="You are a careful software agent. [script:demo]",
                    renderer=renderer,
                    timeout_seconds=180,
                    destroy_sandboxes=True,
                )
            finally:
                await asyncio.to_thread(stack.stop)
        return 0 if renderer.stop_reason == "end_turn" else 1

    try:
        return asyncio.run(main())
    except (TurnFailed, RuntimeError, OSError) as error:
        print(f"oma demo failed: {error}", file=sys.stderr)
        return 1
