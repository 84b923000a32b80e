"""The harness's model call: the real `anthropic` SDK against the scripted model server."""

from __future__ import annotations

import pytest

from oma.servers.harness.model import ModelFailure, ModelReply, make_client, stream_reply
from oma.servers.harness.model_server.server import start_model_server
from oma.servers.harness.tools import SANDBOX_TOOLS, to_api

SCRIPTS = {
    "scripts": {
        "hello": {"turns": [{"text": "Hello there, streaming in several pieces of text."}]},
        "tool": {
            "turns": [
                {
                    "content": [
                        {"type": "text", "text": "Running it."},
                        {"type": "tool_use", "name": "bash", "input": {"command": "echo hi"}},
                    ]
                }
            ]
        },
        "flaky": {
            "turns": [
                {
                    "text": "finally",
                    "fail": {"error": {"status": 529, "type": "overloaded_error"}, "times": 1},
                }
            ]
        },
    },
    "default": "hello",
}


async def _call(
    base_url: str, system: str, messages: list[dict[str, object]], deltas: list[str] | None = None
) -> ModelReply:
    async def on_text(text: str) -> None:
        if deltas is not None:
            deltas.append(text)

    client = make_client(base_url)
    try:
        return await stream_reply(
            client,
            model="claude-sonnet-5",
            system=system,
            messages=messages,
            tools=to_api(SANDBOX_TOOLS.values()),
            max_tokens=256,
            on_text=on_text,
        )
    finally:
        await client.close()


async def test_streams_text_and_reports_usage() -> None:
    async with await start_model_server(SCRIPTS) as server:
        deltas: list[str] = []
        reply = await _call(
            server.base_url, "[script:hello]", [{"role": "user", "content": "hi"}], deltas
        )
    assert reply.text == "Hello there, streaming in several pieces of text."
    assert "".join(deltas) == reply.text
    assert reply.usage.output_tokens > 0
    # The whole prompt was written to the (simulated) prompt cache.
    assert reply.usage.cache_creation_input_tokens > 0
    assert reply.tool_calls == () and reply.stop_reason == "end_turn"


async def test_tool_use_comes_back_as_a_tool_call() -> None:
    async with await start_model_server(SCRIPTS) as server:
        reply = await _call(server.base_url, "[script:tool]", [{"role": "user", "content": "go"}])
    assert [(c.name, c.input) for c in reply.tool_calls] == [("bash", {"command": "echo hi"})]
    assert reply.tool_calls[0].id.startswith("toolu_")


async def test_overload_is_retryable_and_then_served() -> None:
    async with await start_model_server(SCRIPTS) as server:
        messages: list[dict[str, object]] = [{"role": "user", "content": "x"}]
        with pytest.raises(ModelFailure) as failure:
            await _call(server.base_url, "[script:flaky]", messages)
        assert failure.value.retryable and failure.value.error_type == "overloaded_error"
        reply = await _call(server.base_url, "[script:flaky]", messages)
    assert reply.text == "finally"


async def test_model_server_rejects_a_request_the_real_api_would_reject() -> None:
    # A tool_result that answers no tool_use of the previous assistant turn.
    bad = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}],
        },
    ]
    async with await start_model_server(SCRIPTS) as server:
        with pytest.raises(ModelFailure) as failure:
            await _call(server.base_url, "[script:hello]", bad)
        rejections = server.rejections()
    assert failure.value.status_code == 400
    assert failure.value.error_type == "invalid_request_error"
    assert not failure.value.retryable
    assert len(rejections) == 1
