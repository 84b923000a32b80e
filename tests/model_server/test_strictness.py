"""Requests the real API refuses are refused here too, with the real error shape."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from model_server_scripts import MODEL, SCRIPTS, TOOLS

from oma.servers.harness.model_server import AsyncModelServer, start_model_server

HEADERS = {"x-api-key": "k", "anthropic-version": "2023-06-01"}


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def tool_use(tool_id: str, name: str = "bash") -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": name, "input": {"command": "ls"}}


def tool_result(tool_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_id, "content": "ok"}


def cached(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}


BASE: dict[str, Any] = {"model": MODEL, "max_tokens": 100}

# (name, request overrides, a fragment the error message must contain)
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("empty messages", {"messages": []}, "at least one message"),
    (
        "first message from the assistant",
        {"messages": [assistant("hi")]},
        'first message must use the "user" role',
    ),
    ("two user messages in a row", {"messages": [user("a"), user("b")]}, "roles must alternate"),
    (
        "two assistant messages in a row",
        {"messages": [user("a"), assistant("b"), assistant("c"), user("d")]},
        "roles must alternate",
    ),
    (
        "unknown role",
        {"messages": [user("a"), {"role": "robot", "content": "b"}]},
        "messages.1: Input tag 'robot' found using 'role' does not match any of the expected tags",
    ),
    (
        "unknown block type",
        {"messages": [user([{"type": "picture", "url": "x"}])]},
        "messages.0.content.0: Input tag 'picture' found using 'type'",
    ),
    (
        "tool_use block without input",
        {
            "messages": [
                user("a"),
                assistant([{"type": "tool_use", "id": "t", "name": "bash"}]),
                user("b"),
            ],
            "tools": TOOLS,
        },
        "messages.1.content.0.tool_use.input: Field required",
    ),
    (
        "system message inside messages",
        {"messages": [user("a"), {"role": "system", "content": "b"}]},
        'unexpected role "system"',
    ),
    (
        "thinking budget below the minimum",
        {"messages": [user("a")], "thinking": {"type": "enabled", "budget_tokens": 100}},
        "budget_tokens: Input should be greater than or equal to 1024",
    ),
    (
        "thinking budget above max_tokens",
        {
            "messages": [user("a")],
            "max_tokens": 2000,
            "thinking": {"type": "enabled", "budget_tokens": 4000},
        },
        "`max_tokens` must be greater than `thinking.budget_tokens`",
    ),
    (
        "tool_result without a tool_use",
        {"messages": [user([tool_result("toolu_x")])]},
        "unexpected `tool_use_id` found in `tool_result` blocks: toolu_x",
    ),
    (
        "tool_result answering a tool_use two turns back",
        {
            "messages": [
                user("a"),
                assistant([tool_use("toolu_1")]),
                user([tool_result("toolu_1")]),
                assistant("done"),
                user([tool_result("toolu_1")]),
            ],
            "tools": TOOLS,
        },
        "messages.4.content.0: unexpected `tool_use_id`",
    ),
    (
        "unanswered tool_use",
        {
            "messages": [
                user("a"),
                assistant([tool_use("toolu_1"), tool_use("toolu_2")]),
                user([tool_result("toolu_1")]),
            ],
            "tools": TOOLS,
        },
        "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_2",
    ),
    (
        "duplicate tool names",
        {"messages": [user("a")], "tools": [TOOLS[0], TOOLS[0]]},
        "Tool names must be unique",
    ),
    (
        "five cache_control breakpoints",
        {"messages": [user([cached(f"part {i}") for i in range(5)])]},
        "A maximum of 4 blocks with cache_control may be provided. Found 5.",
    ),
    (
        "prefill ending in whitespace",
        {"messages": [user("a"), assistant("The answer is ")]},
        "final assistant content cannot end with trailing whitespace",
    ),
    (
        "empty text block",
        {"messages": [user([{"type": "text", "text": ""}])]},
        "text content blocks must be non-empty",
    ),
    (
        "empty message content",
        {"messages": [user([]), assistant("x"), user("y")]},
        "must have non-empty content",
    ),
    (
        "unknown top-level field",
        {"messages": [user("a")], "temprature": 0.5},
        "temprature: Extra inputs are not permitted",
    ),
    (
        "unknown block field",
        {"messages": [user([{"type": "text", "text": "a", "colour": "red"}])]},
        "messages.0.content.0.text.colour: Extra inputs are not permitted",
    ),
    (
        "tool without input_schema",
        {"messages": [user("a")], "tools": [{"name": "x"}]},
        "tools.0.input_schema: Field required",
    ),
    ("max_tokens of zero", {"messages": [user("a")], "max_tokens": 0}, "max_tokens"),
    (
        "tool_choice naming an unknown tool",
        {"messages": [user("a")], "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice.name",
    ),
]


@pytest.mark.parametrize(
    ("name", "overrides", "fragment"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
async def test_bad_request_is_rejected_like_the_real_api(
    client: anthropic.AsyncAnthropic,
    model_server: AsyncModelServer,
    name: str,
    overrides: dict[str, Any],
    fragment: str,
) -> None:
    request = {**BASE, **overrides}
    extra_body = {k: v for k, v in request.items() if k == "temprature"}
    request = {k: v for k, v in request.items() if k != "temprature"}
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(**request, extra_body=extra_body or None)
    error = caught.value
    assert error.status_code == 400
    assert isinstance(error.body, dict)
    assert error.body["type"] == "error"
    assert error.body["error"]["type"] == "invalid_request_error"
    assert fragment in error.body["error"]["message"], error.body["error"]["message"]
    assert fragment in error.message
    rejections = model_server.rejections()
    assert len(rejections) == 1 and fragment in rejections[0]["message"]


async def test_missing_required_fields_are_rejected(model_server: AsyncModelServer) -> None:
    async with httpx.AsyncClient(base_url=model_server.base_url, headers=HEADERS) as http:
        for body, fragment in [
            ({"max_tokens": 10, "messages": [user("a")]}, "model: Field required"),
            ({"model": MODEL, "messages": [user("a")]}, "max_tokens: Field required"),
            ({"model": MODEL, "max_tokens": 10}, "messages: Field required"),
            ({"model": MODEL, "max_tokens": "ten", "messages": [user("a")]}, "max_tokens"),
        ]:
            response = await http.post("/v1/messages", json=body)
            assert response.status_code == 400
            payload = response.json()
            assert (
                payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
            )
            assert fragment in payload["error"]["message"]
            assert response.headers["request-id"] == payload["request_id"]
        response = await http.post("/v1/messages", content=b"{not json")
        assert response.status_code == 400
        assert "error parsing the body" in response.json()["error"]["message"]


async def test_missing_api_key_is_401(model_server: AsyncModelServer) -> None:
    async with httpx.AsyncClient(base_url=model_server.base_url) as http:
        response = await http.post(
            "/v1/messages",
            json={**BASE, "messages": [user("a")]},
            headers={"anthropic-version": "2023-06-01"},
        )
    assert response.status_code == 401
    assert response.json()["error"] == {
        "type": "authentication_error",
        "message": "x-api-key header is required",
    }


async def test_configured_key_and_models_are_enforced() -> None:
    server = await start_model_server(SCRIPTS, api_key="secret", models=frozenset({MODEL}))
    try:
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="wrong", max_retries=0
        ) as bad:
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(**BASE, messages=[user("a")])
        async with anthropic.AsyncAnthropic(
            base_url=server.base_url, api_key="secret", max_retries=0
        ) as good:
            with pytest.raises(anthropic.NotFoundError) as caught:
                await good.messages.create(
                    model="claude-unknown", max_tokens=10, messages=[user("a")]
                )
            assert caught.value.body["error"]["type"] == "not_found_error"
            ok = await good.messages.create(**BASE, messages=[user("a")])
            assert ok.content
    finally:
        await server.stop()


async def test_script_exhausted_and_undeclared_tool_are_reported(
    client: anthropic.AsyncAnthropic, model_server: AsyncModelServer
) -> None:
    history = [user("a"), assistant("b"), user("c"), assistant("d"), user("e")]
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(**BASE, messages=history)
    assert "has 2 turns but the request asks for turn 3" in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(**BASE, system="[script:tools]", messages=[user("a")])
    assert "does not declare in `tools`" in caught.value.message
    assert len(model_server.rejections()) == 2


async def test_rejections_endpoint(
    client: anthropic.AsyncAnthropic, model_server: AsyncModelServer
) -> None:
    await client.messages.create(**BASE, messages=[user("fine")])
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(**BASE, messages=[assistant("bad")])
    async with httpx.AsyncClient(base_url=model_server.base_url) as http:
        listed = (await http.get("/_oma/rejections")).json()
        assert [r["status"] for r in listed] == [400]
        assert listed[0]["path"] == "/v1/messages"
        assert (await http.delete("/_oma/rejections")).json() == []
        assert (await http.get("/_oma/rejections")).json() == []


async def test_valid_full_featured_request_is_accepted(
    client: anthropic.AsyncAnthropic, model_server: AsyncModelServer
) -> None:
    message = await client.messages.create(
        model=MODEL,
        max_tokens=100,
        system=[cached("You are helpful.")],
        tools=[*TOOLS[:1], {**TOOLS[1], "cache_control": {"type": "ephemeral"}}],
        tool_choice={"type": "auto"},
        metadata={"user_id": "chat:42"},
        stop_sequences=["STOP"],
        messages=[
            user([{"type": "text", "text": "run it"}]),
            assistant([{"type": "text", "text": "ok"}, tool_use("toolu_a")]),
            user([tool_result("toolu_a"), cached("and now?")]),
        ],
    )
    assert message.content[0].text == "Goodbye."
    assert model_server.rejections() == []
