"""The HTTP application: the Anthropic Messages API over scripted turns.

Routes:

* `POST /v1/messages`: JSON, or Server-Sent Events when `stream: true` (`message_start`,
  `ping`, then per block `content_block_start` / `content_block_delta` (`text_delta`,
  `input_json_delta`, `thinking_delta` + `signature_delta`) / `content_block_stop`, then
  `message_delta` with the stop reason and usage, and `message_stop`);
* `POST /v1/messages/count_tokens`: `{"input_tokens": N}` by the estimate in `cache.py`;
* `GET /_oma/rejections`: every request refused with 400/401/404 so far (a list of
  `{"status", "type", "message", "path", "request_id"}`), so a test can assert that a
  harness never sent a malformed request; `DELETE` clears it. Besides what the real API
  refuses, two script mismatches land here too: a request past the script's last turn, and a
  scripted `tool_use` of a tool the request does not declare;
* `GET /_oma/served`: every turn served so far (`{"script", "turn", "conversation",
  "stream", "chosen_by", "messages", "prompt_tokens", "first_user_text"}`: how the turn was
  chosen, `record` or `count` (see `turns.py`), and the request's size), in order; `DELETE`
  clears it.

Errors use the real shape: `{"type": "error", "error": {"type", "message"}, "request_id"}`
with the matching status (400 invalid_request_error, 401 authentication_error, 404
not_found_error, and scripted ones such as 529 overloaded_error).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from oma.servers.harness.model_server.cache import (
    PromptCache,
    PromptUsage,
    count_input_tokens,
    estimate_tokens,
)
from oma.servers.harness.model_server.script import (
    Failure,
    Script,
    ScriptBook,
    conversation_key,
    first_user_text,
    render_content,
    stable_id,
    turn_index,
)
from oma.servers.harness.model_server.ttft import Ttft
from oma.servers.harness.model_server.turns import ServedTurns
from oma.servers.harness.model_server.validate import InvalidRequest, validate_request

DELTA_CHARS = 24  # streamed text is cut into deltas this long so previews visibly stream
FIRST_USER_CHARS = 200  # how much of the first user message `/_oma/served` shows


class ApiError(Exception):
    """An error answered with the real API's error shape."""

    def __init__(
        self, status: int, kind: str, message: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


@dataclass
class ServerState:
    """Everything the server remembers between requests; safe to share across threads."""

    book: ScriptBook
    ttft: Ttft = field(default_factory=Ttft)
    api_key: str | None = None
    models: frozenset[str] | None = None
    delta_delay_ms: float = 0.0
    cache: PromptCache = field(default_factory=PromptCache)
    turns: ServedTurns = field(default_factory=ServedTurns)
    rejections: list[dict[str, Any]] = field(default_factory=list)
    served: list[dict[str, Any]] = field(default_factory=list)
    _failures_seen: dict[tuple[str, str, int], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_failure(self, script: Script, key: str, turn_no: int) -> Failure | None:
        """The scripted failure this request must get, if any (counts per conversation)."""
        failures = script.turns[turn_no].failures
        if not failures:
            return None
        with self.lock:
            seen = self._failures_seen.get((script.name, key, turn_no), 0)
            self._failures_seen[(script.name, key, turn_no)] = seen + 1
        for failure in failures:
            if seen < failure.times:
                return failure
            seen -= failure.times
        return None


def _error_response(error: ApiError, request_id: str) -> JSONResponse:
    headers = {"request-id": request_id}
    if error.retry_after is not None:
        headers["retry-after"] = f"{error.retry_after:g}"
    body = {
        "type": "error",
        "error": {"type": error.kind, "message": error.message},
        "request_id": request_id,
    }
    return JSONResponse(body, status_code=error.status, headers=headers)


def _check_headers(request: Request, state: ServerState) -> None:
    key = request.headers.get("x-api-key")
    bearer = request.headers.get("authorization", "")
    if not key and bearer.lower().startswith("bearer "):
        key = bearer[7:].strip()
    if not key:
        raise ApiError(401, "authentication_error", "x-api-key header is required")
    if state.api_key is not None and key != state.api_key:
        raise ApiError(401, "authentication_error", "invalid x-api-key")
    if not request.headers.get("anthropic-version"):
        raise ApiError(400, "invalid_request_error", "anthropic-version: header is required")


async def _read_body(request: Request, kind: str) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(
            400, "invalid_request_error", "There was an error parsing the body of your request"
        ) from None
    if kind == "create" and isinstance(body, dict) and body.get("stream") is True:
        kind = "stream"
    try:
        return validate_request(body, kind=kind)
    except InvalidRequest as exc:
        raise ApiError(400, "invalid_request_error", exc.message) from None


def _usage(prompt: PromptUsage, output_tokens: int, overrides: Mapping[str, int]) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "input_tokens": prompt.input_tokens,
        "cache_creation_input_tokens": prompt.cache_creation_input_tokens,
        "cache_read_input_tokens": prompt.cache_read_input_tokens,
        "output_tokens": output_tokens,
    }
    usage.update(overrides)
    usage["cache_creation"] = {
        "ephemeral_5m_input_tokens": usage["cache_creation_input_tokens"],
        "ephemeral_1h_input_tokens": 0,
    }
    usage["service_tier"] = "standard"
    return usage


def _output_tokens(content: Iterable[Mapping[str, Any]]) -> int:
    total = 0
    for block in content:
        if block["type"] == "text":
            total += estimate_tokens(block["text"])
        elif block["type"] == "thinking":
            total += estimate_tokens(block["thinking"])
        else:
            total += estimate_tokens(block["name"] + json.dumps(block["input"]))
    return total


def _chunks(text: str, size: int = DELTA_CHARS) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _sse(event: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def _stream_events(
    message: dict[str, Any],
    usage: dict[str, Any],
    delta_delay_ms: float,
    fail_with: Failure | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body; with `fail_with`, an `error` event replaces the rest after the first delta."""
    start_usage = {**usage, "output_tokens": 1}
    yield _sse(
        "message_start",
        {
            "type": "message_start",
            "message": {
                **message,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
            },
        },
    )
    yield _sse("ping", {"type": "ping"})
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            start: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": c} for c in _chunks(block["text"])]
        elif block["type"] == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": c} for c in _chunks(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": ""}]
            deltas += [
                {"type": "input_json_delta", "partial_json": c}
                for c in _chunks(json.dumps(block["input"], separators=(",", ":")))
            ]
        yield _sse(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": start},
        )
        for delta in deltas:
            if delta_delay_ms:
                await asyncio.sleep(delta_delay_ms / 1000)
            yield _sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
            if fail_with is not None:
                error = {"type": fail_with.type, "message": fail_with.message}
                yield _sse("error", {"type": "error", "error": error})
                return
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})
    delta_usage = {
        k: usage[k]
        for k in (
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
            "output_tokens",
        )
    }
    yield _sse(
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": delta_usage,
        },
    )
    yield _sse("message_stop", {"type": "message_stop"})


def _choose_turn(
    book: ScriptBook, turns: ServedTurns, key: str, body: Mapping[str, Any]
) -> tuple[Script, int, str]:
    """The script and turn that answer this request, and how the turn was chosen (`record`:
    after the turn that produced its last assistant message; `count`: by counting them);
    ApiError 400 when none answers."""
    script = book.select(body)
    if script is None:
        raise ApiError(
            400,
            "invalid_request_error",
            "no script answers this request: put [script:NAME] in the system prompt or start "
            f"metadata.user_id with NAME (scripts: {', '.join(sorted(book.scripts))})",
        )
    following = turns.following(key, script.name, body.get("messages") or [])
    turn_no, by = (turn_index(body), "count") if following is None else (following, "record")
    if turn_no >= len(script.turns):
        why = (
            f"it holds {turn_no} assistant messages"
            if by == "count"
            else f"its last assistant message is turn {turn_no} as served"
        )
        raise ApiError(
            400,
            "invalid_request_error",
            f"script {script.name!r} has {len(script.turns)} turns but the request asks for "
            f"turn {turn_no + 1} ({why})",
        )
    return script, turn_no, by


def _check_tools_declared(
    body: Mapping[str, Any], script: Script, turn_no: int, content: Iterable[Mapping[str, Any]]
) -> None:
    # A real model only calls tools it was offered; a scripted call to an undeclared tool
    # means the client forgot to send its tools, which a test should hear about.
    declared = sorted(str(t.get("name")) for t in body.get("tools") or [])
    for block in content:
        if block["type"] == "tool_use" and block["name"] not in declared:
            raise ApiError(
                400,
                "invalid_request_error",
                f"script {script.name!r} turn {turn_no} calls tool {block['name']!r}, which the "
                f"request does not declare in `tools` ({', '.join(declared) or 'none'})",
            )


def build_app(state: ServerState) -> Starlette:
    """The Starlette application serving `state`."""

    def reject(request: Request, error: ApiError, request_id: str) -> JSONResponse:
        if error.status in (400, 401, 404):
            with state.lock:
                state.rejections.append(
                    {
                        "status": error.status,
                        "type": error.kind,
                        "message": error.message,
                        "path": request.url.path,
                        "request_id": request_id,
                    }
                )
        return _error_response(error, request_id)

    async def messages(request: Request) -> Response:
        request_id = "req_" + uuid.uuid4().hex[:24]
        try:
            _check_headers(request, state)
            body = await _read_body(request, "create")
            if state.models is not None and body["model"] not in state.models:
                raise ApiError(404, "not_found_error", f"model: {body['model']}")
            key = conversation_key(body)
            script, turn_no, chosen_by = _choose_turn(state.book, state.turns, key, body)
            content = render_content(script, turn_no, key)
            _check_tools_declared(body, script, turn_no, content)
            state.turns.record(key, script.name, turn_no, content)
        except ApiError as error:
            return reject(request, error, request_id)
        turn = script.turns[turn_no]
        delay_ms = turn.ttft_ms if turn.ttft_ms is not None else state.ttft.sample_ms()
        if delay_ms > 0:
            await asyncio.sleep(delay_ms / 1000)
        stream = bool(body.get("stream"))
        failure = state.next_failure(script, key, turn_no)
        if failure is not None and not (stream and failure.mid_stream):
            return _error_response(
                ApiError(
                    failure.status, failure.type, failure.message, retry_after=failure.retry_after
                ),
                request_id,
            )
        prompt = state.cache.account(key, body)
        usage = _usage(prompt, _output_tokens(content), turn.usage)
        message = {
            "id": stable_id("msg_", key, script.name, turn_no),
            "type": "message",
            "role": "assistant",
            "model": body["model"],
            "content": content,
            "stop_reason": turn.stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }
        if failure is None:
            with state.lock:
                state.served.append(
                    {
                        "script": script.name,
                        "turn": turn_no,
                        "conversation": key,
                        "stream": stream,
                        "chosen_by": chosen_by,
                        "messages": len(body["messages"]),
                        "prompt_tokens": prompt.total,
                        "first_user_text": first_user_text(body)[:FIRST_USER_CHARS],
                    }
                )
        headers = {"request-id": request_id}
        if not stream:
            return JSONResponse(message, headers=headers)
        return StreamingResponse(
            _stream_events(message, usage, state.delta_delay_ms, failure),
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
        )

    async def count_tokens(request: Request) -> Response:
        request_id = "req_" + uuid.uuid4().hex[:24]
        try:
            _check_headers(request, state)
            body = await _read_body(request, "count_tokens")
        except ApiError as error:
            return reject(request, error, request_id)
        return JSONResponse(
            {"input_tokens": count_input_tokens(body)}, headers={"request-id": request_id}
        )

    async def rejections(request: Request) -> Response:
        with state.lock:
            if request.method == "DELETE":
                state.rejections.clear()
            return JSONResponse(list(state.rejections))

    async def served(request: Request) -> Response:
        with state.lock:
            if request.method == "DELETE":
                state.served.clear()
            return JSONResponse(list(state.served))

    return Starlette(
        routes=[
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/_oma/rejections", rejections, methods=["GET", "DELETE"]),
            Route("/_oma/served", served, methods=["GET", "DELETE"]),
        ]
    )
