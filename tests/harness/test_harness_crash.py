"""Kill the harness at every named fault point; a second harness resumes from the log.

For each point: the session completes, the log has no gap and no duplicate, each tool call
ran exactly once (the tool appends a line to a file in the sandbox, and the file is read
back at the end), and the session has exactly one sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness_helpers import HarnessFactory, Peers, SessionClient, payload, types, wake

from oma.cli._stack import _wait_for_address
from oma.harness.v1 import harness_pb2
from oma.sandbox.v1 import sandbox_pb2
from oma.servers.harness.faults import ENV, POINTS
from oma.servers.harness.model_server.server import AsyncModelServer, start_model_server
from oma.session.v1 import session_service_pb2

SCRIPTS: dict[str, Any] = {
    "scripts": {
        "crashy": {
            "turns": [
                {
                    "content": [
                        {"type": "text", "text": "Step one, counting runs."},
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "echo run1 >> count.txt; sleep 1; echo done1"},
                        },
                    ]
                },
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "echo run2 >> count.txt"},
                        }
                    ]
                },
                {"text": "All done."},
            ]
        }
    }
}


@pytest.fixture
async def model() -> AsyncIterator[AsyncModelServer]:
    async with await start_model_server(SCRIPTS) as server:
        yield server
        assert server.rejections() == []


def spawn_faulty_harness(
    peers: Peers, model_url: str, point: str, tmp: Path
) -> tuple[subprocess.Popen[bytes], str]:
    log = tmp / "faulty-harness.log"
    env = {**os.environ, ENV: point}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oma.cli.main",
                "serve",
                "harness",
                "--listen",
                "127.0.0.1:0",
                "--session",
                peers.session,
                "--sandbox",
                peers.sandbox,
                "--tokens",
                str(peers.tokens_file),
                "--model-base-url",
                model_url,
                "--lease-ttl-seconds",
                "2",
                "--grace-seconds",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    return proc, _wait_for_address("harness", proc, log, 60)


async def wake_until_taken(peers: Peers, address: str, session_id: str) -> int:
    """Wake until the dead harness's lease has expired and this one decided."""
    deadline = time.monotonic() + 30
    while True:
        answer = await wake(peers, address, session_id)
        if answer.outcome != harness_pb2.WAKE_OUTCOME_ALREADY_DRIVEN:
            return int(answer.outcome)
        assert time.monotonic() < deadline, "the dead harness's lease never expired"
        await asyncio.sleep(0.3)


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
async def test_a_harness_killed_at_any_point_is_replaced_without_loss_or_repeat(
    point: str,
    tmp_path: Path,
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    client = local_client
    session_id = await client.create("crashy", tools=("bash",))
    faulty, address = spawn_faulty_harness(local_peers, model.base_url, point, tmp_path)
    try:
        try:
            await wake(local_peers, address, session_id)
        except grpc.aio.AioRpcError:
            assert point == "after_lease"  # it died before answering
        await asyncio.to_thread(faulty.wait, 60)
    finally:
        if faulty.poll() is None:
            faulty.kill()
    assert faulty.returncode == -9, (tmp_path / "faulty-harness.log").read_text()

    survivor = await harness_factory(local_peers, model.base_url)
    outcome = await wake_until_taken(local_peers, survivor.address, session_id)
    if point == "after_idle":
        assert outcome == harness_pb2.WAKE_OUTCOME_NOTHING_TO_DO
    else:
        assert outcome == harness_pb2.WAKE_OUTCOME_STARTED
        await client.wait_idle(session_id)
        assert await survivor.driver.settled(session_id) in ("end_turn", None)

    events = list(
        (
            await client.sessions.GetEvents(
                session_service_pb2.GetEventsRequest(session_id=session_id, page_size=1000)
            )
        ).events
    )
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert len({e.id for e in events}) == len(events)
    assert types(events).count("session.status_idle") == 1
    assert events[-1].type == "session.status_idle"
    assert events[-1].session_status_idle.stop_reason == 1  # END_TURN
    uses = [e.tool_use_id for e in events if e.type == "agent.tool_use"]
    results = [e.tool_use_id for e in events if e.type == "agent.tool_result"]
    assert len(uses) == 2 and sorted(uses) == sorted(results)
    assert [r.is_error for r in payload(events, "agent.tool_result")] == [False, False]
    assert payload(events, "agent.message")[-1].content[0].text == "All done."

    sandboxes = await client.sandboxes_of(session_id, include_terminated=True)
    assert len(sandboxes) == 1
    check = await client.sandboxes.Execute(
        sandbox_pb2.ExecuteRequest(
            sandbox_id=sandboxes[0].id,
            name="bash",
            input_json=json.dumps({"command": "cat count.txt"}),
        )
    )
    assert check.output.split() == ["run1", "run2"]
