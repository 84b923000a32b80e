"""A real stack for the worker tests: `oma serve session` on a fresh PostgreSQL database,
`oma serve sandbox --backend local` (bubblewrap) and `oma model-server`, all child processes;
each test starts its `oma serve harness --worker` processes itself."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from workers_helpers import Client, Stack, launch, launch_session, stop_all, write_script

from oma.runtime.auth import TokenTable

SCRIPTS = {
    # Two model calls around one tool call: long enough to overlap and to be killed midway.
    "work": {
        "turns": [
            {
                "content": [
                    {"type": "text", "text": "Computing."},
                    {
                        "type": "tool_use",
                        "name": "bash",
                        "input": {"command": "sleep 0.3; echo $((6 * 7))"},
                    },
                ]
            },
            {"text": "The answer is 42."},
        ]
    },
    # A tool that is still running when its worker is told to stop; the second tool shows
    # how many times the first one ran.
    "slow": {
        "turns": [
            {
                "content": [
                    {
                        "type": "tool_use",
                        "name": "bash",
                        "input": {"command": "echo run >> count.txt; sleep 3; echo slept"},
                    }
                ]
            },
            {
                "content": [
                    {"type": "tool_use", "name": "bash", "input": {"command": "cat count.txt"}}
                ]
            },
            {"text": "Napped once."},
        ]
    },
    "chat": {"turns": [{"text": "Hello from a worker."}]},
}


@pytest.fixture
def stack(tmp_path: Path, pg_database: str, bwrap_path: str) -> Iterator[Stack]:
    tokens_file = tmp_path / "tokens.json"
    TokenTable.generate().save(tokens_file)
    db = pg_database.replace("postgresql://", "postgresql+asyncpg://", 1)
    common = ["--listen", "127.0.0.1:0", "--grace-seconds", "1", "--tokens", str(tokens_file)]
    # Started together, awaited one by one: the three start in parallel.
    launched = [
        launch_session(tmp_path / "session.log", tokens_file, db),
        launch(
            ["serve", "sandbox", *common, "--backend", "local"],
            tmp_path / "sandbox.log",
            r"oma sandbox serving on (\S+)",
        ),
        launch(
            [
                "model-server",
                "--script",
                str(write_script(tmp_path / "scripts.json", SCRIPTS)),
                "--listen",
                "127.0.0.1:0",
                "--ttft",
                "uniform:100,400",
            ],
            tmp_path / "model.log",
            r"model server listening on (\S+)",
        ),
    ]
    procs = [item.proc for item in launched]
    s: Stack | None = None
    try:
        session_address, sandbox_address, model_url = (item.address() for item in launched)
        s = Stack(
            tmp_path,
            TokenTable.load(tokens_file),
            tokens_file,
            session_address,
            sandbox_address,
            model_url,
            db,
            procs,
        )
        yield s
        # The scripted model server is as strict as the real API: it accepted every request.
        rejections = httpx.get(f"{model_url}/_oma/rejections").json()
        assert rejections == [], rejections
    finally:
        workers = [w.proc for w in s.workers] if s is not None else []
        stop_all(workers)  # first, so no worker sees its session service go away
        stop_all(procs)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[Client]:
    c = Client(stack)
    yield c
    await c.close()
