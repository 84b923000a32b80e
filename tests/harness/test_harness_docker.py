"""Sessions on the Docker sandbox backend, including a sandbox killed with `docker kill`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness_helpers import HarnessFactory, Peers, SessionClient, payload, types, wake

from oma.servers.harness.model_server.server import AsyncModelServer, start_model_server

pytestmark = pytest.mark.docker

SCRIPTS: dict[str, Any] = {
    "scripts": {
        "program": {
            "turns": [
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "write",
                            "input": {"path": "hello.py", "content": "print(6 * 7)\n"},
                        }
                    ]
                },
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "python3 hello.py"},
                        }
                    ]
                },
                {"text": "It printed 42."},
            ]
        },
        "fragile": {
            "turns": [
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "echo first > note.txt && cat note.txt"},
                        }
                    ]
                },
                # The model "thinks" long enough for the test to kill the sandbox meanwhile.
                {
                    "ttft_ms": 2500,
                    "content": [
                        {"type": "tool_use", "name": "bash", "input": {"command": "cat note.txt"}}
                    ],
                },
                {
                    "content": [
                        {"type": "text", "text": "The sandbox died; trying again."},
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "echo again > note.txt && cat note.txt"},
                        },
                    ]
                },
                {"text": "Recovered on a fresh sandbox."},
            ]
        },
        "no_image": {
            "turns": [
                {"content": [{"type": "tool_use", "name": "bash", "input": {"command": "true"}}]},
                {"text": "No sandbox could be started."},
            ]
        },
    }
}


@pytest.fixture
async def model() -> AsyncIterator[AsyncModelServer]:
    async with await start_model_server(SCRIPTS) as server:
        yield server
        assert server.rejections() == []


async def test_a_tool_session_on_docker(
    docker_peers: Peers,
    docker_client_oma: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    client = docker_client_oma
    harness = await harness_factory(docker_peers, model.base_url)
    session_id = await client.create("program")
    waiting = asyncio.create_task(client.wait_idle(session_id))
    await wake(docker_peers, harness.address, session_id)
    events, _ = await waiting
    results = payload(events, "agent.tool_result")
    assert [r.is_error for r in results] == [False, False]
    assert "42" in results[1].content[0].text
    assert payload(events, "session.status_idle")[0].stop_reason == 1
    sandboxes = await client.sandboxes_of(session_id, include_terminated=True)
    assert len(sandboxes) == 1 and sandboxes[0].backend == "docker"


async def test_a_killed_sandbox_is_an_error_result_and_the_session_recovers(
    docker_peers: Peers,
    docker_client_oma: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
    docker_client: Any,
) -> None:
    client = docker_client_oma
    harness = await harness_factory(docker_peers, model.base_url)
    session_id = await client.create("fragile", tools=("bash",))
    killed: list[str] = []

    def kill_session_containers() -> None:
        for container in docker_client.containers.list(
            filters={"label": f"oma.dev/session-id={session_id}"}
        ):
            container.kill()
            killed.append(container.id)

    async def on_event(event: Any) -> None:
        if event.type == "agent.tool_result" and not killed:
            await asyncio.to_thread(kill_session_containers)

    waiting = asyncio.create_task(client.wait_idle(session_id, on_event=on_event))
    await wake(docker_peers, harness.address, session_id)
    events, _ = await waiting
    assert len(killed) == 1
    results = payload(events, "agent.tool_result")
    assert [r.is_error for r in results] == [False, True, False]
    assert results[0].content[0].text.strip() == "first"
    assert "sandbox" in results[1].content[0].text.lower()
    assert results[2].content[0].text.strip() == "again"
    assert payload(events, "agent.message")[-1].content[0].text == "Recovered on a fresh sandbox."
    assert payload(events, "session.status_idle")[0].stop_reason == 1
    assert types(events).count("session.status_idle") == 1
    sandboxes = await client.sandboxes_of(session_id, include_terminated=True)
    assert len(sandboxes) == 2
    live = await client.sandboxes_of(session_id)
    assert (len(live) == 1 and live[0].id != sandboxes[0].id) or len(live) == 1


async def test_a_sandbox_that_cannot_be_provisioned_is_an_error_result(
    docker_peers: Peers,
    docker_client_oma: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    client = docker_client_oma
    harness = await harness_factory(docker_peers, model.base_url)
    session_id = await client.create(
        "no_image", tools=("bash",), image="oma-test-no-such-image:never"
    )
    waiting = asyncio.create_task(client.wait_idle(session_id))
    await wake(docker_peers, harness.address, session_id)
    events, _ = await waiting
    (result,) = payload(events, "agent.tool_result")
    assert result.is_error and "IMAGE_NOT_FOUND" in result.content[0].text
    assert payload(events, "agent.message")[-1].content[0].text == "No sandbox could be started."
    assert payload(events, "session.status_idle")[0].stop_reason == 1
    assert await client.sandboxes_of(session_id) == []
