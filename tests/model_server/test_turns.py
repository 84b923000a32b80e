"""Turn selection when the client trims its history: the turn after the last one served."""

from __future__ import annotations

from typing import Any

import anthropic
from model_server_scripts import MODEL, SCRIPTS, TOOLS

from oma.servers.harness.model_server import AsyncModelServer, start_model_server


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def results_for(content: list[Any]) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": "ok"}
            for b in content
            if b.type == "tool_use"
        ],
    }


async def _create(client: anthropic.AsyncAnthropic, messages: list[Any]) -> Any:
    return await client.messages.create(
        model=MODEL,
        max_tokens=1000,
        system="[script:tools]",
        tools=TOOLS,
        messages=messages,
        metadata={"user_id": "trimmed-session"},
    )


async def test_a_trimmed_history_gets_the_next_turn(
    client: anthropic.AsyncAnthropic, model_server: AsyncModelServer
) -> None:
    task = user("write and run a program")
    first = await _create(client, [task])
    second = await _create(
        client,
        [task, {"role": "assistant", "content": first.content}, results_for(first.content)],
    )
    # Turn 0 is left out: one assistant message, but it is turn 1 as served.
    trimmed = [task, {"role": "assistant", "content": second.content}, results_for(second.content)]
    third = await _create(client, trimmed)
    assert third.content[0].text == "It printed 1."
    served = model_server.served()
    assert [(s["turn"], s["chosen_by"]) for s in served] == [
        (0, "count"),
        (1, "record"),
        (2, "record"),
    ]
    assert served[2]["messages"] == 3
    assert served[2]["first_user_text"] == "write and run a program"
    # The same trimmed request again (a retry) gets the same turn.
    again = await _create(client, trimmed)
    assert again.model_dump() == third.model_dump()
    assert model_server.rejections() == []


async def test_a_fresh_server_falls_back_to_counting() -> None:
    async with await start_model_server(SCRIPTS) as first_server:
        async with anthropic.AsyncAnthropic(
            base_url=first_server.base_url, api_key="test", max_retries=0
        ) as client:
            task = user("write and run a program")
            first = await _create(client, [task])
    # A new server never served `first`: the position decides (one assistant message: turn 1).
    async with await start_model_server(SCRIPTS) as fresh:
        async with anthropic.AsyncAnthropic(
            base_url=fresh.base_url, api_key="test", max_retries=0
        ) as client:
            history = [task, {"role": "assistant", "content": first.content}]
            second = await _create(client, [*history, results_for(first.content)])
        assert [b.input for b in second.content if b.type == "tool_use"] == [
            {"command": "python3 a.py"}
        ]
        assert [(s["turn"], s["chosen_by"]) for s in fresh.served()] == [(1, "count")]


async def test_served_text_is_recognised_and_unknown_text_counted(
    client: anthropic.AsyncAnthropic, model_server: AsyncModelServer
) -> None:
    # "chat" serves distinct texts; a hand-written assistant text the server never served
    # falls back to counting, and a served one picks the turn after it.
    history = [user("hi"), {"role": "assistant", "content": "Hello! How can I help?"}, user("x")]
    unknown = [user("hi"), {"role": "assistant", "content": "Something else."}, user("x")]
    first = await client.messages.create(model=MODEL, max_tokens=100, messages=[user("hi")])
    assert first.content[0].text == "Hello! How can I help?"
    second = await client.messages.create(model=MODEL, max_tokens=100, messages=history)
    third = await client.messages.create(model=MODEL, max_tokens=100, messages=unknown)
    assert second.content[0].text == third.content[0].text == "Goodbye."
    assert [s["chosen_by"] for s in model_server.served()] == ["count", "record", "count"]
