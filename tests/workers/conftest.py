"""A real stack for the worker tests: `oma serve session` on a fresh PostgreSQL database,
`oma serve sandbox --backend local` (bubblewrap) and `oma model-server`, all child processes;
each test starts its `oma serve harness --worker` processes itself."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from workers_helpers import Client, Stack, spawn, spawn_session, stop, write_script

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
    common = ["--listen", "127.0.0.1:0", "--grace-seconds", "1", "--tokens", str(tokens_file)]
    procs: list[subprocess.Popen[bytes]] = []
    s: Stack | None = None
    try:
        db = pg_database.replace("postgresql://", "postgresql+asyncpg://", 1)
        session, session_address = spawn_session(tmp_path / "session.log", tokens_file, db)
        procs.append(session)
        sandbox, sandbox_address = spawn(
            ["serve", "sandbox", *common, "--backend", "local"],
            tmp_path / "sandbox.log",
            r"oma sandbox serving on (\S+)",
        )
        procs.append(sandbox)
        model, model_url = spawn(
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
        )
        procs.append(model)
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
        for worker in s.workers if s is not None else []:
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.proc.wait()
        for proc in reversed(procs):
            stop(proc)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[Client]:
    c = Client(stack)
    yield c
    await c.close()
