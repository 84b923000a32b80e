"""Prompt-cache accounting on a growing conversation."""

from __future__ import annotations

from typing import Any

import anthropic
from model_server_scripts import MODEL

from oma.servers.harness.model_server import AsyncModelServer

SYSTEM = "You are a careful assistant. " * 20


def cached(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}


def plain(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


async def _usage(
    client: anthropic.AsyncAnthropic, **kwargs: Any
) -> tuple[anthropic.types.Usage, int]:
    message = await client.messages.create(model=MODEL, max_tokens=100, **kwargs)
    counted = await client.messages.count_tokens(
        model=MODEL, **{k: v for k, v in kwargs.items() if k != "metadata"}
    )
    usage = message.usage
    assert (
        usage.cache_read_input_tokens is not None and usage.cache_creation_input_tokens is not None
    )
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert total == counted.input_tokens, "the three input figures must add up to the whole prompt"
    return usage, total


async def test_growing_conversation_reads_its_earlier_prefix(
    client: anthropic.AsyncAnthropic, model_server: AsyncModelServer
) -> None:
    meta = {"user_id": "chat:conversation-1"}
    system = [cached(SYSTEM)]
    first, first_total = await _usage(
        client,
        system=system,
        metadata=meta,
        messages=[{"role": "user", "content": [cached("hi " * 30)]}],
    )
    assert first.cache_read_input_tokens == 0
    assert first.cache_creation_input_tokens == first_total and first.input_tokens == 0

    second_messages = [
        {"role": "user", "content": [plain("hi " * 30)]},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": [cached("tell me more " * 10)]},
    ]
    second, second_total = await _usage(
        client, system=system, metadata=meta, messages=second_messages
    )
    # Everything the first request cached is a prefix of the second: read back in full.
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == second_total - first_total
    assert second.input_tokens == 0

    # The same request again (a harness retrying after a crash) reads everything.
    replay, _ = await _usage(client, system=system, metadata=meta, messages=second_messages)
    assert replay.cache_read_input_tokens == second_total
    assert replay.cache_creation_input_tokens == 0

    # Another conversation with the same prompt starts cold.
    other, _ = await _usage(
        client, system=system, metadata={"user_id": "chat:conversation-2"}, messages=second_messages
    )
    assert other.cache_read_input_tokens == 0


async def test_tokens_after_the_last_breakpoint_are_plain_input(
    client: anthropic.AsyncAnthropic,
) -> None:
    meta = {"user_id": "chat:system-only"}
    messages = [{"role": "user", "content": "question " * 40}]
    first, total = await _usage(client, system=[cached(SYSTEM)], metadata=meta, messages=messages)
    assert first.cache_read_input_tokens == 0
    assert 0 < first.cache_creation_input_tokens < total
    assert first.input_tokens == total - first.cache_creation_input_tokens
    second, _ = await _usage(client, system=[cached(SYSTEM)], metadata=meta, messages=messages)
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.input_tokens == first.input_tokens


async def test_no_cache_control_means_no_caching(client: anthropic.AsyncAnthropic) -> None:
    for _ in range(2):
        usage, total = await _usage(
            client, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
        )
        assert usage.cache_read_input_tokens == 0 and usage.cache_creation_input_tokens == 0
        assert usage.input_tokens == total


async def test_changed_prefix_misses(client: anthropic.AsyncAnthropic) -> None:
    meta = {"user_id": "chat:changed"}
    messages = [{"role": "user", "content": [cached("hello " * 20)]}]
    await _usage(client, system=[cached(SYSTEM)], metadata=meta, messages=messages)
    changed, total = await _usage(
        client, system=[cached(SYSTEM + " Be brief.")], metadata=meta, messages=messages
    )
    assert changed.cache_read_input_tokens == 0
    assert changed.cache_creation_input_tokens == total


async def test_streaming_reports_cache_usage(client: anthropic.AsyncAnthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 100,
        "system": [cached(SYSTEM)],
        "metadata": {"user_id": "chat:stream"},
        "messages": [{"role": "user", "content": "hi"}],
    }
    await client.messages.create(**kwargs)
    async with client.messages.stream(**kwargs) as stream:
        final = await stream.get_final_message()
    assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 0
    assert final.usage.cache_creation_input_tokens == 0


async def test_top_level_cache_control_caches_the_whole_prompt(
    client: anthropic.AsyncAnthropic,
) -> None:
    kwargs: dict[str, Any] = {
        "system": SYSTEM,
        "metadata": {"user_id": "chat:auto"},
        "messages": [{"role": "user", "content": "hi"}],
        "cache_control": {"type": "ephemeral"},
    }
    first = (await client.messages.create(model=MODEL, max_tokens=10, **kwargs)).usage
    second = (await client.messages.create(model=MODEL, max_tokens=10, **kwargs)).usage
    assert first.input_tokens == 0 and first.cache_creation_input_tokens
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
