"""Rendering a session's `StreamEvents` in a terminal: readable, coloured when it is a TTY.

Previews (the model's text while it streams) are printed as they arrive; the stored
`agent.message` that follows only completes the line, unless the previews were missed, in
which case the stored text is printed whole.
"""

from __future__ import annotations

import json
import os
import sys
from typing import TextIO

from oma.session.v1 import events_pb2, session_service_pb2

_MAX_OUTPUT_LINES = 30


class Style:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)

    def yellow(self, text: str) -> str:
        return self._wrap("33", text)

    def cyan(self, text: str) -> str:
        return self._wrap("36", text)

    def magenta(self, text: str) -> str:
        return self._wrap("35", text)


def want_colour(stream: TextIO) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return stream.isatty()


def _text(blocks: object) -> str:
    return "\n".join(b.text for b in blocks if b.WhichOneof("block") == "text")  # type: ignore[attr-defined]


def _indent(text: str, prefix: str = "    ") -> str:
    lines = text.rstrip("\n").splitlines() or [""]
    if len(lines) > _MAX_OUTPUT_LINES:
        hidden = len(lines) - _MAX_OUTPUT_LINES
        lines = [*lines[:_MAX_OUTPUT_LINES], f"… ({hidden} more lines)"]
    return "\n".join(prefix + line for line in lines)


def _tool_summary(name: str, input_json: str) -> str:
    try:
        data = json.loads(input_json or "{}")
    except ValueError:
        return input_json
    if not isinstance(data, dict):
        return input_json
    if name == "bash" and "command" in data:
        return f"$ {data['command']}"
    if name == "write" and "path" in data:
        content = str(data.get("content", ""))
        return f"{data['path']} ({len(content.splitlines())} lines)\n" + _indent(content)
    return json.dumps(data, ensure_ascii=False)


class Renderer:
    """Prints one session's events; `finished` is set by the idle that ends the watched turn."""

    def __init__(self, out: TextIO = sys.stdout, colour: bool | None = None) -> None:
        self.out = out
        self.s = Style(want_colour(out) if colour is None else colour)
        self._preview = ""
        self.stop_reason = ""
        self.final_text = ""

    def _line(self, text: str) -> None:
        self._end_preview()
        print(text, file=self.out, flush=True)

    def _end_preview(self) -> None:
        if self._preview:
            print(file=self.out, flush=True)
            self._preview = ""

    def handle(self, item: session_service_pb2.StreamEventsResponse) -> None:
        if item.WhichOneof("item") == "preview":
            if not self._preview:
                print(self.s.magenta("assistant "), end="", file=self.out)
            self._preview += item.preview.text_delta
            print(item.preview.text_delta, end="", file=self.out, flush=True)
            return
        self.event(item.event)

    def event(self, e: events_pb2.Event) -> None:
        kind = e.WhichOneof("payload")
        s = self.s
        if kind == "session_created":
            d = e.session_created.definition
            tools = ", ".join(t.name for t in d.tools) or "none"
            self._line(s.dim(f"session created · model {d.model} · tools: {tools}"))
        elif kind == "user_message":
            self._line(s.bold(s.green("user ")) + _text(e.user_message.content))
        elif kind == "session_status_running":
            self._line(s.dim("· harness running"))
        elif kind == "agent_message":
            text = _text(e.agent_message.content)
            self.final_text = text
            if self._preview and self._preview.strip() == text.strip():
                self._end_preview()
            else:
                self._preview = ""
                self._line(s.magenta("assistant ") + text)
        elif kind == "agent_tool_use":
            u = e.agent_tool_use
            self._line(s.cyan(f"tool use  {u.name} ") + _tool_summary(u.name, u.input_json))
        elif kind == "agent_custom_tool_use":
            custom = e.agent_custom_tool_use
            self._line(
                s.cyan(f"custom tool {custom.name} ")
                + custom.input_json
                + s.dim("  (run by the client)")
            )
        elif kind == "agent_mcp_tool_use":
            m = e.agent_mcp_tool_use
            self._line(s.cyan(f"mcp tool  {m.server_name}/{m.name} ") + m.input_json)
        elif kind == "agent_mcp_tool_result":
            mr = e.agent_mcp_tool_result
            label = s.red("mcp tool error") if mr.is_error else s.cyan("mcp tool result")
            body = _indent(_text(mr.content))
            self._line(f"{label}\n{s.red(body) if mr.is_error else body}")
        elif kind == "user_custom_tool_result":
            answer = e.user_custom_tool_result
            self._line(s.green("custom tool result\n") + _indent(_text(answer.content)))
        elif kind == "user_tool_confirmation":
            c = e.user_tool_confirmation
            allowed = c.result == events_pb2.TOOL_CONFIRMATION_RESULT_ALLOW
            verdict = "allowed" if allowed else f"denied {c.deny_message}".rstrip()
            self._line(s.green(f"user {verdict} tool call {e.tool_use_id}"))
        elif kind == "user_interrupt":
            self._line(s.yellow("user interrupt ") + e.user_interrupt.reason)
        elif kind == "agent_tool_result":
            r = e.agent_tool_result
            label = s.red("tool error") if r.is_error else s.cyan("tool result")
            body = _indent(_text(r.content))
            self._line(f"{label}\n{s.red(body) if r.is_error else body}")
        elif kind == "session_error":
            err = e.session_error
            retry = " (retrying)" if err.retrying else ""
            self._line(s.yellow(f"error {err.code}{retry}: {err.message}"))
        elif kind == "span_model_request_end":
            usage = e.span_model_request_end.usage
            cached = usage.cache_read_input_tokens
            total_in = usage.input_tokens + cached + usage.cache_creation_input_tokens
            note = f" ({cached} from cache)" if cached else ""
            self._line(
                s.dim(f"· model call: {total_in} tokens in{note}, {usage.output_tokens} out")
            )
        elif kind == "session_status_idle":
            reason = events_pb2.StopReason.Name(e.session_status_idle.stop_reason)
            self.stop_reason = reason.removeprefix("STOP_REASON_").lower()
            colour = s.green if self.stop_reason == "end_turn" else s.yellow
            waiting = ", ".join(e.session_status_idle.tool_use_ids)
            note = f": waiting for {waiting}" if waiting else ""
            self._line(colour(f"■ idle ({self.stop_reason}){note}"))
        elif kind in ("session_status_terminated", "session_status_rescheduled"):
            self._line(s.dim(f"· {e.type}"))
