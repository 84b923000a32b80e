"""Sessions that wait for the user: custom tools the client runs, and tool calls that ask for
confirmation first (`requires_action`, then a wake resumes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness_helpers import HarnessFactory, Peers, SessionClient, payload, types, wake

from oma.harness.v1 import harness_pb2
from oma.servers.harness.model_server.server import AsyncModelServer, start_model_server
from oma.session.v1 import events_pb2

REQUIRES_ACTION = events_pb2.STOP_REASON_REQUIRES_ACTION
END_TURN = events_pb2.STOP_REASON_END_TURN

SCRIPTS: dict[str, Any] = {
    "scripts": {
        "weather": {
            "turns": [
                {
                    "content": [
                        {"type": "tool_use", "name": "get_weather", "input": {"city": "Lyon"}}
                    ]
                },
                {"text": "It is sunny in Lyon."},
            ]
        },
        "ponder": {"turns": [{"text": "After long thought: 42.", "ttft_ms": 4000}]},
        "two_steps": {
            "turns": [
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "sleep 1.5; echo first"},
                        },
                        {"type": "tool_use", "name": "bash", "input": {"command": "echo second"}},
                    ]
                },
                {"text": "never asked"},
            ]
        },
        "careful": {
            "turns": [
                {
                    "content": [
                        {
                            "type": "tool_use",
                            "name": "bash",
                            "input": {"command": "echo approved run"},
                        }
                    ]
                },
                {"text": "Finished."},
            ]
        },
    }
}


@pytest.fixture
async def model() -> AsyncIterator[AsyncModelServer]:
    async with await start_model_server(SCRIPTS) as server:
        yield server
        assert server.rejections() == []


async def _turn(
    client: SessionClient, peers: Peers, harness: Any, session_id: str, idle_after: int = 0
) -> list[Any]:
    """Wake the harness; return the log once the turn is idle and its lease released."""
    waiting = asyncio.create_task(client.wait_idle(session_id, idle_after=idle_after))
    answer = await wake(peers, harness.address, session_id)
    assert answer.outcome == harness_pb2.WAKE_OUTCOME_STARTED
    events, _ = await waiting
    await harness.driver.settled(session_id)
    return events


async def test_a_custom_tool_round_trip(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("weather", tools=(), custom_tools=("get_weather",))
    events = await _turn(local_client, local_peers, harness, session_id)
    (use,) = [e for e in events if e.type == "agent.custom_tool_use"]
    assert use.agent_custom_tool_use.name == "get_weather"
    idle = events[-1].session_status_idle
    assert idle.stop_reason == REQUIRES_ACTION and list(idle.tool_use_ids) == [use.tool_use_id]
    # Nothing more to do until the client answers.
    again = await wake(local_peers, harness.address, session_id)
    assert again.outcome == harness_pb2.WAKE_OUTCOME_NOTHING_TO_DO

    await local_client.say(
        session_id,
        tool_use_id=use.tool_use_id,
        user_custom_tool_result=events_pb2.UserCustomToolResult(
            content=[events_pb2.ContentBlock(text="sunny, 24 C")]
        ),
    )
    events = await _turn(local_client, local_peers, harness, session_id, idle_after=events[-1].seq)
    assert payload(events, "agent.message")[-1].content[0].text == "It is sunny in Lyon."
    assert events[-1].session_status_idle.stop_reason == END_TURN
    # The client ran the tool: no sandbox, no agent.tool_result.
    assert "agent.tool_result" not in types(events)
    assert await local_client.sandboxes_of(session_id, include_terminated=True) == []


@pytest.mark.parametrize("allow", [True, False])
async def test_a_tool_that_asks_runs_only_when_allowed(
    allow: bool,
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("careful", tools=("bash",), ask=("bash",))
    events = await _turn(local_client, local_peers, harness, session_id)
    (use,) = [e for e in events if e.type == "agent.tool_use"]
    assert events[-1].session_status_idle.stop_reason == REQUIRES_ACTION
    assert list(events[-1].session_status_idle.tool_use_ids) == [use.tool_use_id]
    assert "agent.tool_result" not in types(events)
    assert await local_client.sandboxes_of(session_id, include_terminated=True) == []

    result = (
        events_pb2.TOOL_CONFIRMATION_RESULT_ALLOW
        if allow
        else events_pb2.TOOL_CONFIRMATION_RESULT_DENY
    )
    await local_client.say(
        session_id,
        tool_use_id=use.tool_use_id,
        user_tool_confirmation=events_pb2.UserToolConfirmation(
            result=result, deny_message="" if allow else "not on this machine"
        ),
    )
    events = await _turn(local_client, local_peers, harness, session_id, idle_after=events[-1].seq)
    (tool_result,) = payload(events, "agent.tool_result")
    sandboxes = await local_client.sandboxes_of(session_id, include_terminated=True)
    if allow:
        assert not tool_result.is_error
        assert tool_result.content[0].text.strip() == "approved run"
        assert len(sandboxes) == 1
    else:
        assert tool_result.is_error
        assert "denied" in tool_result.content[0].text
        assert "not on this machine" in tool_result.content[0].text
        assert sandboxes == []  # a denied call never needs hands
    assert payload(events, "agent.message")[-1].content[0].text == "Finished."
    assert events[-1].session_status_idle.stop_reason == END_TURN


async def test_an_interrupt_cancels_the_model_stream(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("ponder", tools=())

    async def interrupt_when_asked(event: Any) -> None:
        if event.type == "span.model_request_start":
            await local_client.say(
                session_id, user_interrupt=events_pb2.UserInterrupt(reason="changed my mind")
            )

    waiting = asyncio.create_task(local_client.wait_idle(session_id, on_event=interrupt_when_asked))
    await wake(local_peers, harness.address, session_id)
    events, _ = await waiting
    kinds = types(events)
    assert "agent.message" not in kinds
    assert kinds.index("user.interrupt") < kinds.index("span.model_request_end")
    assert payload(events, "span.model_request_end")[0].is_error
    assert events[-1].session_status_idle.stop_reason == END_TURN
    # The turn ended long before the model's 4 s first token would have come: the stream was
    # cancelled, not awaited (checked by the order of events, not by a clock).
    assert await harness.driver.settled(session_id) in ("end_turn", None)


async def test_an_interrupt_mid_tool_starts_no_further_call(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("two_steps", tools=("bash",))

    async def interrupt_during_first(event: Any) -> None:
        if event.type == "span.model_request_end":
            await local_client.say(session_id, user_interrupt=events_pb2.UserInterrupt())

    waiting = asyncio.create_task(
        local_client.wait_idle(session_id, on_event=interrupt_during_first)
    )
    await wake(local_peers, harness.address, session_id)
    events, _ = await waiting
    results = payload(events, "agent.tool_result")
    assert len(results) == 2  # every tool_use keeps a result
    assert results[1].is_error and "interrupted" in results[1].content[0].text
    # The second call never ran; at most the one already running finished.
    assert "second" not in results[1].content[0].text
    assert types(events).count("span.model_request_start") == 1
    assert events[-1].session_status_idle.stop_reason == END_TURN
