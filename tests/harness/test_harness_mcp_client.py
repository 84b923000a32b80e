"""The pure parts of the harness's MCP support: tool names the model sees, and reading
streamable-HTTP answers and `tools/call` results."""

from __future__ import annotations

import json

from oma.servers.harness.mcp_client import (
    MAX_RESULT_CHARS,
    HttpReply,
    _find_response,
    result_output,
)
from oma.servers.harness.tools import TOOL_NAME, mcp_tool_name


def test_tool_names_are_valid_and_distinct() -> None:
    assert mcp_tool_name("github", "create_issue") == "github__create_issue"
    pairs = [("a_", "_b"), ("a", "__b"), ("my server", "x.y"), ("s" * 40, "t" * 40), ("é", "ü")]
    names = [mcp_tool_name(server, tool) for server, tool in pairs]
    assert all(TOOL_NAME.match(name) for name in names), names
    assert len(set(names)) == len(names)
    # A pure function of the pair: the name read back from the log maps to the same tool.
    assert names == [mcp_tool_name(server, tool) for server, tool in pairs]


def test_the_answer_is_found_among_server_sent_events() -> None:
    events = [
        {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}},
        {"jsonrpc": "2.0", "id": 6, "result": {"other": True}},
        {"jsonrpc": "2.0", "id": 7, "result": {"content": []}},
    ]
    body = "".join(f"event: message\ndata: {json.dumps(e)}\n\n" for e in events).encode()
    reply = HttpReply(200, {"content-type": "text/event-stream"}, body)
    assert _find_response(reply, 7) == events[2]
    assert _find_response(reply, 8) is None
    plain = HttpReply(200, {"content-type": "application/json"}, json.dumps(events[1]).encode())
    assert _find_response(plain, 6) == events[1]


def test_results_become_text_for_the_model() -> None:
    output = result_output(
        {
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            ],
            "isError": True,
        }
    )
    assert output.is_error
    assert output.text.splitlines()[0] == "hello" and "image/png" in output.text
    assert "AAAA" not in output.text
    assert result_output({"content": [], "structuredContent": {"n": 1}}).text == '{"n": 1}'
    long = result_output({"content": [{"type": "text", "text": "x" * (MAX_RESULT_CHARS + 5)}]})
    assert long.text.endswith(
        f"{MAX_RESULT_CHARS + 5} characters in all, first {MAX_RESULT_CHARS} shown]"
    )
