"""One streamed call to the model through the real `anthropic` SDK.

The SDK's own retries are off (`max_retries=0`): the loop counts retries itself so that each
failure is logged in the session as `session.error` and the limit is the harness's to set.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx2

from oma.servers.harness.events import Usage


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    input: dict[str, Any]


@dataclass(frozen=True)
class ModelReply:
    """The parts of a finished reply the loop stores."""

    text: str
    tool_calls: tuple[ToolCall, ...]
    stop_reason: str
    usage: Usage
    model: str = ""
    message_id: str = ""


class ModelFailure(Exception):
    """A model call that failed; `retryable` says whether the same request may succeed later."""

    def __init__(
        self, error_type: str, message: str, retryable: bool, status_code: int = 0
    ) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.retryable = retryable
        self.status_code = status_code


# Statuses the real API uses for transient trouble (timeouts, conflicts, rate limits,
# server errors, overload).
_RETRYABLE_STATUS = {408, 409, 429, 500, 502, 503, 504, 529}


def make_client(
    base_url: str | None = None, api_key: str | None = None, timeout_seconds: float = 600.0
) -> anthropic.AsyncAnthropic:
    """A client for the real API, or for the scripted model server when `base_url` is set.

    With no base URL and `ANTHROPIC_API_KEY` set, this drives real Claude. A scripted server
    needs no key, but the SDK insists on one, so a placeholder is used.
    """
    key = api_key or os.environ.get("ANTHROPIC_API_KEY") or ("unused" if base_url else None)
    return anthropic.AsyncAnthropic(
        base_url=base_url,
        api_key=key,
        max_retries=0,
        timeout=httpx2.Timeout(timeout_seconds, connect=10.0),
    )


def classify(error: BaseException) -> ModelFailure:
    if isinstance(error, anthropic.APIStatusError):
        body: dict[str, Any] = error.body if isinstance(error.body, dict) else {}
        raw = body.get("error")
        detail: dict[str, Any] = raw if isinstance(raw, dict) else {}
        kind = str(detail.get("type") or type(error).__name__)
        message = str(detail.get("message") or error.message)
        return ModelFailure(
            kind, message, error.status_code in _RETRYABLE_STATUS, error.status_code
        )
    if isinstance(error, anthropic.APITimeoutError):
        return ModelFailure("timeout_error", str(error) or "model request timed out", True)
    if isinstance(error, anthropic.APIConnectionError | httpx2.TransportError):
        return ModelFailure("connection_error", str(error) or "connection failed", True)
    if isinstance(error, anthropic.APIError):
        # An `error` event in the middle of an SSE stream (e.g. overloaded_error) lands here.
        stream_body = getattr(error, "body", None)
        inner = stream_body.get("error") if isinstance(stream_body, dict) else None
        kind = str(inner.get("type") or "api_error") if isinstance(inner, dict) else "api_error"
        return ModelFailure(kind, str(error), kind != "invalid_request_error")
    raise error


async def stream_reply(
    client: anthropic.AsyncAnthropic,
    *,
    model: str,
    system: str,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    max_tokens: int,
    user_id: str = "",
    cache: bool = True,
    on_text: Callable[[str], Awaitable[None]],
) -> ModelReply:
    """Stream one reply, handing each text delta to `on_text`; raise `ModelFailure` on error."""
    kwargs: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "messages": list(messages)}
    if system:
        kwargs["system"] = system
    if tools:
        kwargs["tools"] = list(tools)
    if cache:
        # Automatic prompt caching: the prompt up to its end becomes a cache breakpoint. The
        # request is rebuilt from an append-only log, so each request's prompt extends the
        # previous one and the next call reads all of it from the cache.
        kwargs["cache_control"] = {"type": "ephemeral"}
    if user_id:
        # An opaque per-conversation id (the session id): the API's abuse tracking key, and
        # what the scripted model server derives its deterministic tool-use ids from.
        kwargs["metadata"] = {"user_id": user_id}
    try:
        async with client.messages.stream(**kwargs) as stream:
            async for event in stream:
                if event.type == "text":
                    await on_text(event.text)
            final = await stream.get_final_message()
    except (anthropic.APIError, httpx2.TransportError) as error:
        raise classify(error) from error
    text = "".join(b.text for b in final.content if b.type == "text")
    calls = tuple(
        ToolCall(b.id, b.name, dict(b.input) if isinstance(b.input, dict) else {})
        for b in final.content
        if b.type == "tool_use"
    )
    u = final.usage
    usage = Usage(
        u.input_tokens or 0,
        u.output_tokens or 0,
        u.cache_read_input_tokens or 0,
        u.cache_creation_input_tokens or 0,
    )
    return ModelReply(text, calls, str(final.stop_reason or ""), usage, final.model, final.id)
