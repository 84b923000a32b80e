"""Scripted turns through the real `anthropic` SDK: JSON, streaming, tools, replay, failures."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import pytest
from model_server_scripts import MODEL, SCRIPTS, TOOLS

from oma.servers.harness.model_server import AsyncModelServer, start_model_server


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


async def test_json_turn(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.create(model=MODEL, max_tokens=100, messages=[user("hi")])
    assert message.role == "assistant"
    assert message.model == MODEL
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello! How can I help?"
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0
    assert message.usage.output_tokens > 0


async def test_streaming_turn_via_sdk(client: anthropic.AsyncAnthropic) -> None:
    deltas: list[str] = []
    async with client.messages.stream(model=MODEL, max_tokens=100, messages=[user("hi")]) as stream:
        async for text in stream.text_stream:
            deltas.append(text)
        final = await stream.get_final_message()
    assert "".join(deltas) == "Hello! How can I help?"
    assert final.content[0].text == "Hello! How can I help?"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 1


async def test_stream_true_on_create(client: anthropic.AsyncAnthropic) -> None:
    events = await client.messages.create(
        model=MODEL, max_tokens=100, messages=[user("hi")], stream=True
    )
    kinds = [event.type async for event in events]
    assert kinds[0] == "message_start"
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert kinds.count("content_block_delta") >= 1


async def test_raw_sse_event_sequence(model_server: AsyncModelServer) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "stream": True,
        "system": "[script:tools]",
        "tools": TOOLS,
        "messages": [user("go")],
    }
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(base_url=model_server.base_url) as http:
        response = await http.post("/v1/messages", json=body, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for chunk in response.text.strip().split("\n\n"):
        event_line, data_line = chunk.split("\n")
        name = event_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append(data)
    names = [e["type"] for e in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    json_parts = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == 1
    ]
    assert all(
        e["delta"]["type"] == "input_json_delta"
        for e in events
        if e.get("index") == 1 and "delta" in e
    )
    assert json.loads("".join(json_parts)) == {"path": "a.py", "content": "print(1)"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"]["output_tokens"] > 1


async def test_thinking_is_streamed(client: anthropic.AsyncAnthropic) -> None:
    kinds: list[str] = []
    async with client.messages.stream(
        model=MODEL, max_tokens=100, system="[script:thinking]", messages=[user("number?")]
    ) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
        final = await stream.get_final_message()
    assert "thinking_delta" in kinds and "signature_delta" in kinds and "text_delta" in kinds
    thinking = final.content[0]
    assert thinking.type == "thinking"
    assert thinking.thinking == "The user wants a number. " * 4
    assert thinking.signature


async def test_tool_use_round_trip(
    client: anthropic.AsyncAnthropic, model_server: AsyncModelServer
) -> None:
    system = "You are a coder. [script:tools]"
    messages: list[dict[str, Any]] = [user("write and run a program")]
    calls: list[tuple[str, dict[str, Any]]] = []
    for _ in range(5):
        async with client.messages.stream(
            model=MODEL,
            max_tokens=1000,
            system=system,
            tools=TOOLS,
            messages=messages,
        ) as stream:
            final = await stream.get_final_message()
        # The assistant message goes back exactly as the SDK parsed it.
        messages.append({"role": "assistant", "content": final.content})
        if final.stop_reason != "tool_use":
            break
        results = []
        for block in final.content:
            if block.type == "tool_use":
                calls.append((block.name, dict(block.input)))
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": "ok"})
        messages.append({"role": "user", "content": results})
    assert calls == [
        ("write", {"path": "a.py", "content": "print(1)"}),
        ("bash", {"command": "ls"}),
        ("bash", {"command": "python3 a.py"}),
    ]
    assert final.stop_reason == "end_turn"
    assert final.content[0].text == "It printed 1."
    assert model_server.rejections() == []
    assert [(s["script"], s["turn"]) for s in model_server.served()] == [
        ("tools", 0),
        ("tools", 1),
        ("tools", 2),
    ]


async def test_replay_by_position_is_deterministic(client: anthropic.AsyncAnthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 100,
        "system": "[script:tools]",
        "tools": TOOLS,
        "messages": [user("go")],
        "metadata": {"user_id": "session-1"},
    }
    first = await client.messages.create(**kwargs)
    again = await client.messages.create(**kwargs)
    assert first.model_dump() == again.model_dump()
    other = await client.messages.create(**{**kwargs, "metadata": {"user_id": "session-2"}})
    first_ids = [b.id for b in first.content if b.type == "tool_use"]
    other_ids = [b.id for b in other.content if b.type == "tool_use"]
    assert len(first_ids) == 2 and len(set(first_ids)) == 2
    assert set(first_ids).isdisjoint(other_ids), "independent sessions must get distinct tool ids"
    assert [b.type for b in other.content] == [b.type for b in first.content]


async def test_turn_follows_the_number_of_assistant_messages(
    client: anthropic.AsyncAnthropic,
) -> None:
    history = [user("hi"), {"role": "assistant", "content": "Hello! How can I help?"}, user("bye")]
    second = await client.messages.create(model=MODEL, max_tokens=100, messages=history)
    assert second.content[0].text == "Goodbye."
    assert second.usage.output_tokens == 7  # scripted usage override
    first = await client.messages.create(model=MODEL, max_tokens=100, messages=[user("hi")])
    assert first.content[0].text == "Hello! How can I help?"


async def test_script_selection(client: anthropic.AsyncAnthropic) -> None:
    by_marker = await client.messages.create(
        model=MODEL,
        max_tokens=10,
        system=[{"type": "text", "text": "x [script:truncated] y"}],
        messages=[user("a")],
    )
    assert by_marker.stop_reason == "max_tokens"
    by_user_id = await client.messages.create(
        model=MODEL, max_tokens=10, metadata={"user_id": "thinking:abc"}, messages=[user("a")]
    )
    assert by_user_id.content[0].type == "thinking"
    by_default = await client.messages.create(
        model=MODEL, max_tokens=10, metadata={"user_id": "nobody"}, messages=[user("a")]
    )
    assert by_default.content[0].text == "Hello! How can I help?"


async def test_injected_overload_then_success(client: anthropic.AsyncAnthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 10,
        "system": "[script:flaky]",
        "messages": [user("a")],
    }
    for _ in range(2):
        with pytest.raises(anthropic.APIStatusError) as caught:
            await client.messages.create(**kwargs)
        assert caught.value.status_code == 529
        assert caught.value.body["error"]["type"] == "overloaded_error"
    message = await client.messages.create(**kwargs)
    assert message.content[0].text == "Served at last."
    # Another conversation has its own failure budget.
    with pytest.raises(anthropic.APIStatusError):
        await client.messages.create(**{**kwargs, "messages": [user("b")]})


async def test_injected_overload_in_streaming(client: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with client.messages.stream(
            model=MODEL, max_tokens=10, system="[script:flaky]", messages=[user("s")]
        ) as stream:
            await stream.get_final_message()
    assert caught.value.status_code == 529


async def test_sdk_retries_through_injected_failures(model_server: AsyncModelServer) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=model_server.base_url, api_key="k", max_retries=2
    ) as retrying:
        message = await retrying.messages.create(
            model=MODEL, max_tokens=10, system="[script:flaky]", messages=[user("retry me")]
        )
    assert message.content[0].text == "Served at last."


async def test_server_ttft_is_applied() -> None:
    server = await start_model_server(SCRIPTS, ttft="fixed:200")
    try:
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="k", max_retries=0
        ) as c:
            started = time.monotonic()
            await c.messages.create(model=MODEL, max_tokens=10, messages=[user("a")])
            json_elapsed = time.monotonic() - started
            started = time.monotonic()
            async with c.messages.stream(
                model=MODEL, max_tokens=10, messages=[user("b")]
            ) as stream:
                async for _ in stream:
                    break
            first_event = time.monotonic() - started
    finally:
        await server.stop()
    assert json_elapsed >= 0.2
    assert first_event >= 0.2


async def test_turn_ttft_override(client: anthropic.AsyncAnthropic) -> None:
    started = time.monotonic()
    await client.messages.create(
        model=MODEL, max_tokens=10, system="[script:slow]", messages=[user("a")]
    )
    assert time.monotonic() - started >= 0.3


async def test_count_tokens(client: anthropic.AsyncAnthropic) -> None:
    short = await client.messages.count_tokens(model=MODEL, messages=[user("hi")])
    longer = await client.messages.count_tokens(
        model=MODEL,
        messages=[user("hi " * 200)],
        tools=TOOLS,
    )
    assert 0 < short.input_tokens < longer.input_tokens


async def test_threaded_server_serves_sync_clients() -> None:
    from oma.servers.harness.model_server import start_model_server_in_thread

    with start_model_server_in_thread(SCRIPTS) as server:
        sync_client = anthropic.Anthropic(base_url=server.base_url, api_key="k", max_retries=0)
        message = sync_client.messages.create(model=MODEL, max_tokens=10, messages=[user("hi")])
        assert message.content[0].text == "Hello! How can I help?"
        sync_client.close()


async def test_mid_stream_error_event() -> None:
    scripts = {
        "name": "midway",
        "turns": [
            {
                "text": "A long answer that will be interrupted the first time.",
                "fail": {
                    "error": {"status": 529, "type": "overloaded_error", "message": "Overloaded"},
                    "mid_stream": True,
                },
            }
        ],
    }
    server = await start_model_server(scripts)
    try:
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="k", max_retries=0
        ) as c:
            received: list[str] = []
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with c.messages.stream(
                    model=MODEL, max_tokens=100, messages=[user("a")]
                ) as stream:
                    async for text in stream.text_stream:
                        received.append(text)
            assert caught.value.body["error"]["type"] == "overloaded_error"
            assert (
                received
                and "".join(received) != "A long answer that will be interrupted the first time."
            )
            assert server.served() == []
            async with c.messages.stream(
                model=MODEL, max_tokens=100, messages=[user("a")]
            ) as stream:
                final = await stream.get_final_message()
            assert final.content[0].text == "A long answer that will be interrupted the first time."
            assert len(server.served()) == 1
    finally:
        await server.stop()
