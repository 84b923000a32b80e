"""`oma up` then `oma run` against it, as separate processes, and a clean SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oma.servers.harness.model_server.server import start_model_server

SCRIPTS = {
    "scripts": {
        "hello": {"turns": [{"text": "Hello from the scripted model."}]},
        "shell": {
            "turns": [
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "echo the answer is $((6 * 7))"},
                        }
                    ]
                },
                {"text": "The shell says 42."},
            ]
        },
    }
}


def _oma(*args: str) -> list[str]:
    return [sys.executable, "-m", "oma.cli.main", *args]


def _start_up(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(_oma("up", *args), env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_oma_up_then_oma_run(tmp_path: Path, bwrap_path: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OMA_"))}
    env.update(OMA_HOME=str(tmp_path / "oma"), NO_COLOR="1")
    async with await start_model_server(SCRIPTS) as model:
        log = tmp_path / "up.log"
        up = await asyncio.to_thread(
            _start_up,
            ["--random-ports", "--backend", "local", "--model-base-url", model.base_url],
            env,
            log,
        )
        try:
            deadline = time.monotonic() + 120
            while "Ready." not in log.read_text():
                assert up.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.1)
            text = log.read_text()
            for name in ("session", "sandbox", "vault", "harness", "tokens"):
                assert f"\n{name}" in f"\n{text}"
            state = json.loads((tmp_path / "oma" / "up.json").read_text())
            assert state["sandbox_backend"] == "local"

            for script, expected in (
                ("hello", "Hello from the scripted model."),
                ("shell", "the answer is 42"),
            ):
                run = await asyncio.to_thread(
                    subprocess.run,
                    _oma("run", "--system", f"[script:{script}]", "go"),
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                assert run.returncode == 0, run.stdout + run.stderr
                assert expected in run.stdout
                assert "idle (end_turn)" in run.stdout
                # It used the running stack, not an embedded one.
                assert "embedded" not in run.stderr
        finally:
            up.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(up.wait, 120)
    assert code == 0, log.read_text()
    assert "stopped" in log.read_text()
    assert not (tmp_path / "oma" / "up.json").exists()
