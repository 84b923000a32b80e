"""Whole sessions over real servers: session and sandbox servers (child processes), the
scripted model server, and the harness, all talking gRPC or HTTP over real sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness_helpers import HarnessFactory, Peers, SessionClient, payload, types, wake

from oma.harness.v1 import harness_pb2, harness_pb2_grpc
from oma.runtime.client import connect
from oma.servers.harness.model_server.server import AsyncModelServer, start_model_server

SCRIPTS: dict[str, Any] = {
    "scripts": {
        "hello": {"turns": [{"text": "Hello! No tools needed for this one, thank you."}]},
        "program": {
            "turns": [
                {
                    "content": [
                        {"type": "text", "text": "Writing the program."},
                        {
                            "type": "tool_use",
                            "name": "write",
                            "input": {"path": "hello.py", "content": "print(6 * 7)\n"},
                        },
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
                {"text": "The program printed 42."},
            ]
        },
        "flaky": {
            "turns": [
                {
                    "text": "Served after one overload.",
                    "fail": {"error": {"status": 529, "type": "overloaded_error"}, "times": 1},
                }
            ]
        },
        "down": {
            "turns": [
                {
                    "text": "never served",
                    "fail": {"error": {"status": 529, "type": "overloaded_error"}, "times": 100},
                }
            ]
        },
        "loop": {
            "turns": [
                {"content": [{"type": "tool_use", "name": "bash", "input": {"command": "echo 1"}}]},
                {"content": [{"type": "tool_use", "name": "bash", "input": {"command": "echo 2"}}]},
                {"text": "done"},
            ]
        },
        "slow": {"turns": [{"text": "Slowly, but here I am.", "ttft_ms": 1500}]},
        "readme": {
            "turns": [
                {
                    "content": [
                        {"type": "tool_use", "name": "read", "input": {"path": "notes/todo.txt"}}
                    ]
                },
                {"text": "Read it."},
            ]
        },
    }
}


@pytest.fixture
async def model() -> AsyncIterator[AsyncModelServer]:
    async with await start_model_server(SCRIPTS) as server:
        yield server
        # Every request the harness built was one the real API would accept.
        assert server.rejections() == []


async def test_a_session_without_tools_never_gets_a_sandbox(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("hello")
    waiting = asyncio.create_task(local_client.wait_idle(session_id))
    woken = await wake(local_peers, harness.address, session_id)
    assert woken.outcome == harness_pb2.WAKE_OUTCOME_STARTED
    events, previews = await waiting
    assert types(events) == [
        "session.created",
        "user.message",
        "session.status_running",
        "span.model_request_start",
        "agent.message",
        "span.model_request_end",
        "session.status_idle",
    ]
    message = payload(events, "agent.message")[0].content[0].text
    assert message == "Hello! No tools needed for this one, thank you."
    assert "".join(p.text_delta for p in previews) == message
    end = payload(events, "span.model_request_end")[0]
    assert end.usage.cache_creation_input_tokens > 0 and end.usage.output_tokens > 0
    assert payload(events, "session.status_idle")[0].stop_reason == 1  # END_TURN
    assert await local_client.sandboxes_of(session_id, include_terminated=True) == []
    # Waking the session as soon as it is idle does nothing, even before the turn's task
    # has released its lease (HARNESS-WAKE-003).
    again = await wake(local_peers, harness.address, session_id)
    assert again.outcome == harness_pb2.WAKE_OUTCOME_NOTHING_TO_DO


async def test_a_tool_session_provisions_exactly_one_sandbox_after_the_first_model_call(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("program")
    sandboxes_at_first_reply: list[Any] = []

    async def on_event(event: Any) -> None:
        if event.type == "span.model_request_end" and not sandboxes_at_first_reply:
            sandboxes_at_first_reply.append(await local_client.sandboxes_of(session_id, True))

    waiting = asyncio.create_task(local_client.wait_idle(session_id, on_event=on_event))
    await wake(local_peers, harness.address, session_id)
    events, _ = await waiting
    uses = payload(events, "agent.tool_use")
    results = payload(events, "agent.tool_result")
    assert [u.name for u in uses] == ["write", "bash"]
    assert [r.is_error for r in results] == [False, False]
    assert "42" in results[1].content[0].text
    assert payload(events, "agent.message")[-1].content[0].text == "The program printed 42."
    assert payload(events, "session.status_idle")[0].stop_reason == 1
    # Tool results answer their tool uses, by the model's ids.
    ids = [e.tool_use_id for e in events if e.type == "agent.tool_use"]
    assert ids == [e.tool_use_id for e in events if e.type == "agent.tool_result"]
    assert types(events).count("span.model_request_start") == 3
    # Every event the harness wrote names the one turn the user message opened.
    user_seq = next(e.seq for e in events if e.type == "user.message")
    assert {e.turn_id for e in events if e.seq > user_seq} == {f"turn-{user_seq}"}
    # The prompt is rebuilt from the append-only log, so later calls read its prefix from the
    # prompt cache.
    usages = [end.usage for end in payload(events, "span.model_request_end")]
    assert usages[0].cache_read_input_tokens == 0 and usages[0].cache_creation_input_tokens > 0
    assert all(u.cache_read_input_tokens > 0 for u in usages[1:])
    sandboxes = await local_client.sandboxes_of(session_id, include_terminated=True)
    assert len(sandboxes) == 1
    assert dict(sandboxes[0].labels)["oma.dev/session-id"] == session_id
    # The first model call had completed before the sandbox existed (the span end was
    # appended before the tool use it led to, and no sandbox existed when it was seen, or
    # at the latest it was created after the first span started).
    first_start = next(e for e in events if e.type == "span.model_request_start")
    assert sandboxes[0].create_time.ToDatetime() >= first_start.create_time.ToDatetime()
    assert sandboxes_at_first_reply and len(sandboxes_at_first_reply[0]) <= 1


async def test_two_concurrent_wakes_drive_the_session_once(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    first = await harness_factory(local_peers, model.base_url)
    second = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("slow")
    waiting = asyncio.create_task(local_client.wait_idle(session_id))
    answers = await asyncio.gather(
        wake(local_peers, first.address, session_id),
        wake(local_peers, second.address, session_id),
        wake(local_peers, first.address, session_id),
        wake(local_peers, second.address, session_id),
    )
    outcomes = sorted(a.outcome for a in answers)
    assert outcomes.count(harness_pb2.WAKE_OUTCOME_STARTED) == 1
    assert outcomes.count(harness_pb2.WAKE_OUTCOME_ALREADY_DRIVEN) == 3
    driver = next(a.holder_id for a in answers if a.outcome == harness_pb2.WAKE_OUTCOME_STARTED)
    assert all(a.holder_id == driver for a in answers)
    await waiting
    await asyncio.sleep(0.5)  # anything a second driver might write would land now
    all_events, _ = await local_client.wait_idle(session_id)
    assert types(all_events) == [
        "session.created",
        "user.message",
        "session.status_running",
        "span.model_request_start",
        "agent.message",
        "span.model_request_end",
        "session.status_idle",
    ]
    assert len(model.served()) == 1


async def test_a_model_error_is_retried_and_logged(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url, max_model_retries=2)
    session_id = await local_client.create("flaky")
    waiting = asyncio.create_task(local_client.wait_idle(session_id))
    await wake(local_peers, harness.address, session_id)
    events, _ = await waiting
    errors = payload(events, "session.error")
    assert len(errors) == 1 and errors[0].retrying and errors[0].code == "overloaded_error"
    assert payload(events, "agent.message")[0].content[0].text == "Served after one overload."
    assert payload(events, "session.status_idle")[0].stop_reason == 1


async def test_retries_exhausted(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url, max_model_retries=2)
    session_id = await local_client.create("down")
    waiting = asyncio.create_task(local_client.wait_idle(session_id))
    await wake(local_peers, harness.address, session_id)
    events, _ = await waiting
    errors = payload(events, "session.error")
    assert [e.retrying for e in errors] == [True, True, False]
    assert {e.code for e in errors} == {"overloaded_error"}
    assert "agent.message" not in types(events)
    assert payload(events, "span.model_request_end")[0].is_error
    assert payload(events, "session.status_idle")[0].stop_reason == 3  # RETRIES_EXHAUSTED


@pytest.mark.parametrize("budgets", [{"max_model_calls_per_turn": 2}, {"max_total_tokens": 1}])
async def test_budget_reached(
    budgets: dict[str, int],
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("loop", tools=("bash",), budgets=budgets)
    waiting = asyncio.create_task(local_client.wait_idle(session_id))
    await wake(local_peers, harness.address, session_id)
    events, _ = await waiting
    calls = types(events).count("span.model_request_start")
    assert calls == (2 if "max_model_calls_per_turn" in budgets else 1)
    # Every tool call the model made got its result before the harness stopped.
    assert types(events).count("agent.tool_result") == calls
    assert payload(events, "session.error")[-1].code == "budget_reached"
    assert payload(events, "session.status_idle")[0].stop_reason == 4  # BUDGET_REACHED
    assert json.loads(payload(events, "agent.tool_use")[0].input_json) == {"command": "echo 1"}


async def test_wake_errors_and_capabilities(
    local_peers: Peers, model: AsyncModelServer, harness_factory: HarnessFactory
) -> None:
    import grpc

    from oma.runtime.errors import error_info

    harness = await harness_factory(local_peers, model.base_url)
    async with connect(harness.address, token=local_peers.tokens.token_for("client")) as channel:
        stub = harness_pb2_grpc.HarnessServiceStub(channel)
        caps = await stub.GetCapabilities(harness_pb2.GetCapabilitiesRequest())
        assert "oma.harness.v1" in caps.server_info.api_versions
        assert caps.server_info.limits["harness.max_model_retries"] == 2
        for session_id, code, reason in [
            ("", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"),
            ("not/a valid id", grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"),
            ("ses_unknown", grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await stub.Wake(harness_pb2.WakeRequest(session_id=session_id))
            assert failure.value.code() == code
            info = error_info(failure.value)
            assert info is not None and info.reason == reason
            assert failure.value.details()
    # A sandbox-server token may not wake a harness.
    async with connect(
        harness.address, token=local_peers.tokens.token_for("sandbox_server")
    ) as channel:
        stub = harness_pb2_grpc.HarnessServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await stub.Wake(harness_pb2.WakeRequest(session_id="ses_x"))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_harness_shutting_down_reschedules_its_session(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    first = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create("slow")
    started = asyncio.Event()

    async def on_event(event: Any) -> None:
        if event.type == "span.model_request_start":
            started.set()

    watching = asyncio.create_task(local_client.wait_idle(session_id, on_event=on_event))
    assert (await wake(local_peers, first.address, session_id)).outcome == (
        harness_pb2.WAKE_OUTCOME_STARTED
    )
    await asyncio.wait_for(started.wait(), 30)
    await first.stop(1)  # mid model call (the script's first token takes 1.5 s)
    second = await harness_factory(local_peers, model.base_url)
    # The lease was released with the reschedule: the second harness takes over at once.
    assert (await wake(local_peers, second.address, session_id)).outcome == (
        harness_pb2.WAKE_OUTCOME_STARTED
    )
    events, _ = await watching
    kinds = types(events)
    assert kinds.count("session.status_rescheduled") == 1
    assert kinds.index("session.status_rescheduled") < kinds.index("agent.message")
    assert kinds.count("agent.message") == 1
    assert payload(events, "session.status_idle")[0].stop_reason == 1


async def test_the_sandbox_is_provisioned_with_the_session_environment(
    local_peers: Peers,
    local_client: SessionClient,
    model: AsyncModelServer,
    harness_factory: HarnessFactory,
) -> None:
    harness = await harness_factory(local_peers, model.base_url)
    session_id = await local_client.create(
        "readme", tools=("read",), files={"notes/todo.txt": b"water the plants\n"}
    )
    waiting = asyncio.create_task(local_client.wait_idle(session_id))
    await wake(local_peers, harness.address, session_id)
    events, _ = await waiting
    (result,) = payload(events, "agent.tool_result")
    assert not result.is_error and "water the plants" in result.content[0].text
