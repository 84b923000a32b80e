"""The driver's bookkeeping and the edges of a turn: finished sessions are forgotten, input
that lands as a turn ends is not lost, a reschedule after the idle writes nothing, and an MCP
call interrupted by a harness crash is sent again only when it is safe to repeat.

Requirements tested: HARNESS-WAKE-003, HARNESS-MCP-002.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from harness_helpers import HarnessFactory, Peers, SessionClient, payload, types, wake

from oma.harness.v1 import harness_pb2
from oma.runtime.client import connect
from oma.servers.harness import events as ev
from oma.servers.harness.events import NewEvent
from oma.servers.harness.grpc_ports import GrpcSession
from oma.servers.harness.loop import LoopConfig, Turn
from oma.servers.harness.model_server.server import AsyncModelServer, start_model_server
from oma.session.v1 import definition_pb2, events_pb2, session_service_pb2

sys.path.insert(0, str(Path(__file__).parent.parent / "vault"))

SCRIPTS: dict[str, Any] = {
    "scripts": {
        "hello": {"turns": [{"text": "Hello."}]},
        "twice": {"turns": [{"text": "First answer."}, {"text": "Second answer."}]},
        "after_crash": {"turns": [{"text": "unused"}, {"text": "Done after the crash."}]},
    }
}


@pytest.fixture
async def model() -> AsyncIterator[AsyncModelServer]:
    async with await start_model_server(SCRIPTS) as server:
        yield server
        assert server.rejections() == []


async def test_the_driver_forgets_finished_sessions(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    ids = [await local_client.create("hello", tools=()) for _ in range(3)]
    waits = [asyncio.create_task(local_client.wait_idle(i)) for i in ids]
    for session_id in ids:
        woken = await wake(local_peers, harness.address, session_id)
        assert woken.outcome == harness_pb2.WAKE_OUTCOME_STARTED
    await asyncio.gather(*waits)
    for session_id in ids:
        await harness.driver.settled(session_id)
    assert harness.driver.sessions == []
    assert all(harness.driver.task(i) is None for i in ids)


async def test_input_that_arrives_as_a_turn_ends_is_answered(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("twice", tools=())
    outcomes: list[int] = []
    first_idle: list[int] = []

    async def answer_at_once(event: Any) -> None:
        # Said and woken the moment the idle is visible, before or after the lease goes:
        # either this wake starts the next turn, or the ending turn's task takes it on.
        if event.type == "session.status_idle" and not first_idle:
            first_idle.append(event.seq)
            await local_client.say(
                session_id,
                user_message=events_pb2.UserMessage(
                    content=[events_pb2.ContentBlock(text="and again")]
                ),
            )
            outcomes.append((await wake(local_peers, harness.address, session_id)).outcome)

    await wake(local_peers, harness.address, session_id)
    await local_client.wait_idle(session_id, on_event=answer_at_once)
    events, _ = await local_client.wait_idle(session_id, idle_after=first_idle[0])
    assert outcomes[0] in (
        harness_pb2.WAKE_OUTCOME_STARTED,
        harness_pb2.WAKE_OUTCOME_ALREADY_DRIVEN,
    )
    texts = [m.content[0].text for m in payload(events, "agent.message")]
    assert texts == ["First answer.", "Second answer."]
    await harness.driver.settled(session_id)
    assert harness.driver.sessions == []


async def test_a_reschedule_after_the_idle_writes_nothing(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("hello", tools=())
    waiting = asyncio.create_task(local_client.wait_idle(session_id))
    await wake(local_peers, harness.address, session_id)
    await waiting
    await harness.driver.settled(session_id)

    # A turn whose idle is stored, cancelled before it released its lease (the harness shut
    # down in that one round trip).
    async with connect(local_peers.session, token=local_peers.tokens.token_for("harness")) as ch:
        session = GrpcSession(ch)
        lease = await session.acquire_lease(session_id, "test-harness", 10)
        events = await session.read_events(session_id, 0)
        definition = await session.definition(session_id)
        turn = Turn(session, None, None, LoopConfig(), lease, definition, events)  # type: ignore[arg-type]
        await turn.reschedule("shutting down")
        after = await session.read_events(session_id, 0)
        assert [e.type for e in after] == [e.type for e in events]
        assert after[-1].type == ev.STATUS_IDLE

        # With new input after the idle the reschedule is recorded (the next harness resumes).
        await local_client.say(
            session_id,
            user_message=events_pb2.UserMessage(content=[events_pb2.ContentBlock(text="more")]),
        )
        await turn.reschedule("shutting down")
        after = await session.read_events(session_id, 0)
        assert after[-1].type == ev.STATUS_RESCHEDULED
        await session.release_lease(lease)


def box_app(calls: dict[str, int]) -> Any:
    """An MCP server (no credential) with a read-only tool and a tool with side effects."""
    from mcp.server.mcpserver import MCPServer
    from mcp.types import ToolAnnotations

    server = MCPServer("box")

    @server.tool(annotations=ToolAnnotations(readOnlyHint=True))
    def lookup(key: str) -> str:
        """Read a value."""
        calls["lookup"] = calls.get("lookup", 0) + 1
        return f"value of {key}"

    @server.tool()
    def send(to: str) -> str:
        """Send a message (not safe to repeat)."""
        calls["send"] = calls.get("send", 0) + 1
        return f"sent to {to}"

    return server.streamable_http_app(stateless_http=True, json_response=True)


async def test_an_mcp_call_cut_by_a_crash_is_repeated_only_when_safe(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    from vault_upstreams import LoopbackServer

    calls: dict[str, int] = {}
    box = await LoopbackServer(box_app(calls)).start()
    try:
        created = await local_client.sessions.CreateSession(
            session_service_pb2.CreateSessionRequest(
                request_id=f"crash-{box.port}",
                definition=definition_pb2.SessionDefinition(
                    model="claude-sonnet-5",
                    system_prompt="You are a test agent. [script:after_crash]",
                    mcp_servers=[definition_pb2.McpServer(name="box", url=f"{box.base}/mcp")],
                ),
            )
        )
        session_id = created.session.id
        await local_client.say(
            session_id,
            user_message=events_pb2.UserMessage(content=[events_pb2.ContentBlock(text="go")]),
        )
        # A harness that died right after storing the model's two MCP calls: whether it sent
        # them, nobody can tell.
        async with connect(
            local_peers.session, token=local_peers.tokens.token_for("harness")
        ) as ch:
            session = GrpcSession(ch)
            lease = await session.acquire_lease(session_id, "dead-harness", 10)
            uses = [
                NewEvent(
                    f"use.toolu_{name}",
                    ev.AGENT_MCP_TOOL_USE,
                    tool_use_id=f"toolu_{name}",
                    tool_input=arguments,
                    mcp_server="box",
                    mcp_tool=name,
                )
                for name, arguments in (("lookup", {"key": "k"}), ("send", {"to": "bob"}))
            ]
            await session.append(
                lease, [NewEvent("run.dead", ev.STATUS_RUNNING, turn_id="turn-2"), *uses]
            )
            await session.release_lease(lease)

        harness = await harness_factory(local_peers, model.base_url)
        waiting = asyncio.create_task(local_client.wait_idle(session_id))
        woken = await wake(local_peers, harness.address, session_id)
        assert woken.outcome == harness_pb2.WAKE_OUTCOME_STARTED
        events, _ = await waiting
        results = {
            e.tool_use_id: e.agent_mcp_tool_result
            for e in events
            if e.type == "agent.mcp_tool_result"
        }
        assert results["toolu_lookup"].content[0].text == "value of k"
        assert not results["toolu_lookup"].is_error
        assert results["toolu_send"].is_error
        assert "may or may not have run" in results["toolu_send"].content[0].text
        # The read-only call was sent again; the one with side effects never was.
        assert calls == {"lookup": 1}
        assert "agent.tool_result" not in types(events)
        assert payload(events, "agent.message")[-1].content[0].text == "Done after the crash."
    finally:
        await box.stop()
