"""`oma run "PROMPT"`: one agent turn, watched live in the terminal.

It talks to the stack a running `oma up` recorded in the data directory; when none runs, it
starts an embedded stack on free ports for the duration of the command (and stops it after).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_MODEL = "claude-sonnet-4-6"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="what to ask the agent")
    parser.add_argument(
        "--model",
        default=os.environ.get("OMA_MODEL", DEFAULT_MODEL),
        help=f"model name (default $OMA_MODEL or {DEFAULT_MODEL})",
    )
    parser.add_argument("--system", default="", help="system prompt")
    parser.add_argument(
        "--tools",
        default="bash,read,write,edit,glob,grep",
        help="comma-separated sandbox tools the model may use ('' for none)",
    )
    parser.add_argument(
        "--model-base-url",
        default=os.environ.get("OMA_MODEL_BASE_URL", ""),
        metavar="URL",
        help="for an embedded stack: Messages API base URL",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "docker", "local"],
        default="auto",
        help="for an embedded stack: sandbox backend",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="give up when the turn is not idle after S seconds",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from oma.cli._render import Renderer
    from oma.cli._session import TurnFailed, run_prompt
    from oma.cli._stack import running_stack, start_stack
    from oma.runtime.paths import data_dir

    home = data_dir()
    info = running_stack(home)
    stack = None
    if info is None:
        if not args.model_base_url and not os.environ.get("ANTHROPIC_API_KEY"):
            print(
                "oma run: set ANTHROPIC_API_KEY (or --model-base-url), or try `oma demo`",
                file=sys.stderr,
            )
            return 2
        print("(no `oma up` running: starting an embedded stack)", file=sys.stderr)
        try:
            stack = start_stack(
                home,
                backend=args.backend,
                fixed_ports=False,
                model_base_url=args.model_base_url,
                record=False,
                grace_seconds=2,
            )
        except (RuntimeError, OSError) as error:
            print(f"oma run: {error}", file=sys.stderr)
            return 1
        info = stack.info
    tools = tuple(t for t in args.tools.split(",") if t)
    renderer = Renderer()
    try:
        asyncio.run(
            run_prompt(
                info,
                args.prompt,
                model=args.model,
                system=args.system,
                tools=tools,
                renderer=renderer,
                timeout_seconds=args.timeout,
                destroy_sandboxes=stack is not None,
            )
        )
    except TurnFailed as error:
        print(f"oma run: {error}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()
    return 0 if renderer.stop_reason == "end_turn" else 1
