"""Turning a session log into a Messages API request, and reading the log's state.

The log is the only state a harness has, so everything here is a pure function of the
events read with `GetEvents`: which messages the model sees, which tool calls still wait
for a result, whether there is anything to do at all, and how much budget is spent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oma.servers.harness import events as ev
from oma.servers.harness.events import Definition, LogEvent

Message = dict[str, Any]


_USES = (ev.AGENT_TOOL_USE, ev.AGENT_CUSTOM_TOOL_USE, ev.AGENT_MCP_TOOL_USE)
_RESULTS = (ev.AGENT_TOOL_RESULT, ev.USER_CUSTOM_TOOL_RESULT, ev.AGENT_MCP_TOOL_RESULT)


def _answered(log: Sequence[LogEvent]) -> set[str]:
    return {e.tool_use_id for e in log if e.type in _RESULTS}


def build_messages(log: Sequence[LogEvent]) -> list[Message]:
    """The conversation the log records, as Messages API `messages`.

    Consecutive blocks of one role merge into one message, so role alternation stays valid
    whatever the log's event granularity; in a user message the `tool_result` blocks come
    first, as the API requires. A tool call is answered by an `agent.tool_result` (sandbox
    tools) or a `user.custom_tool_result` (custom tools); a call without an answer is left
    out: the caller settles pending calls before asking the model again.
    """
    answered = _answered(log)
    messages: list[Message] = []

    def add(role: str, block: dict[str, Any]) -> None:
        if messages and messages[-1]["role"] == role:
            content = messages[-1]["content"]
            if block["type"] == "tool_result":
                # tool_result blocks must precede any text in a user turn.
                position = sum(1 for b in content if b["type"] == "tool_result")
                content.insert(position, block)
            else:
                content.append(block)
        else:
            messages.append({"role": role, "content": [block]})

    for event in log:
        if event.type == ev.USER_MESSAGE and event.text:
            add("user", {"type": "text", "text": event.text})
        elif event.type == ev.AGENT_MESSAGE and event.text:
            add("assistant", {"type": "text", "text": event.text})
        elif event.type in _USES and event.tool_use_id in answered:
            add(
                "assistant",
                {
                    "type": "tool_use",
                    "id": event.tool_use_id,
                    "name": event.tool_name,
                    "input": dict(event.tool_input),
                },
            )
        elif event.type in _RESULTS:
            add(
                "user",
                {
                    "type": "tool_result",
                    "tool_use_id": event.tool_use_id,
                    "content": event.text or "(no output)",
                    "is_error": event.is_error,
                },
            )
    return messages


def pending_tool_uses(log: Sequence[LogEvent]) -> list[LogEvent]:
    """Tool calls (`agent.tool_use`, `agent.custom_tool_use`) with no answer yet, in log order."""
    answered = _answered(log)
    return [e for e in log if e.type in _USES and e.tool_use_id not in answered]


def confirmation(log: Sequence[LogEvent], tool_use_id: str) -> LogEvent | None:
    """The user's latest `user.tool_confirmation` of a call, if any."""
    found = None
    for e in log:
        if e.type == ev.USER_TOOL_CONFIRMATION and e.tool_use_id == tool_use_id:
            found = e
    return found


_INPUT = (ev.USER_MESSAGE, ev.USER_TOOL_CONFIRMATION, ev.USER_CUSTOM_TOOL_RESULT)


def has_work(log: Sequence[LogEvent]) -> bool:
    """Whether the log holds input the model (or a waiting tool call) has not answered yet.

    True when a user message, tool confirmation or custom tool result came after the last
    `session.status_idle`, or when a turn was started (a harness wrote something) and never
    reached idle — its harness died. A `user.interrupt` alone is not work.
    """
    last_idle = max((e.seq for e in log if e.type == ev.STATUS_IDLE), default=0)
    if any(e.type == ev.STATUS_TERMINATED for e in log):
        return False
    after = [e for e in log if e.seq > last_idle]
    if any(e.type in _INPUT for e in after):
        return True
    return any(e.type.startswith(("agent.", "span.")) for e in after)


def turn_start(log: Sequence[LogEvent]) -> int:
    """Seq of the user message that opened the current turn (the first one after the last
    idle); the last idle's seq + 1 when the turn has none (a resumed or rescheduled turn)."""
    last_idle = max((e.seq for e in log if e.type == ev.STATUS_IDLE), default=0)
    first = next((e.seq for e in log if e.seq > last_idle and e.type == ev.USER_MESSAGE), 0)
    return first or last_idle + 1


@dataclass(frozen=True)
class Spent:
    """Budget spent so far, read from the log's spans and idle events."""

    total_tokens: int
    turn_output_tokens: int
    turn_model_calls: int
    finished_turns: int


def spent(log: Sequence[LogEvent]) -> Spent:
    """A turn runs from the first user event after an idle to the next idle."""
    last_idle = max((e.seq for e in log if e.type == ev.STATUS_IDLE), default=0)
    total = turn_output = turn_calls = 0
    for e in log:
        if e.type == ev.SPAN_END:
            total += e.usage.total
            if e.seq > last_idle:
                turn_output += e.usage.output_tokens
        elif e.type == ev.SPAN_START and e.seq > last_idle:
            turn_calls += 1
    finished = sum(1 for e in log if e.type == ev.STATUS_IDLE)
    return Spent(total, turn_output, turn_calls, finished)


def budget_reached(definition: Definition, log: Sequence[LogEvent]) -> str:
    """The name of the first budget used up (empty when none is), checked before a model call."""
    used = spent(log)
    d = definition
    if d.max_total_tokens and used.total_tokens >= d.max_total_tokens:
        return "max_total_tokens"
    if d.max_output_tokens_per_turn and used.turn_output_tokens >= d.max_output_tokens_per_turn:
        return "max_output_tokens_per_turn"
    if d.max_model_calls_per_turn and used.turn_model_calls >= d.max_model_calls_per_turn:
        return "max_model_calls_per_turn"
    if d.max_turns and used.finished_turns >= d.max_turns:
        return "max_turns"
    return ""
