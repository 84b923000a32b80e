"""Which tools the model gets, and where each one runs.

The sandbox tools follow Anthropic's agent toolset (`bash`, `read`, `write`, `edit`, `glob`,
`grep`); the harness routes them to `SandboxService.Execute`. A session definition that names
one of them without a schema gets the schema below. MCP tools are offered as
`<server>__<tool>` (`mcp_tool_name`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from oma.servers.harness.events import ToolSpec


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


_STR = {"type": "string"}

SANDBOX_TOOLS: Mapping[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec(
            "bash",
            "Run a bash command in the sandbox workspace; returns its output.",
            _schema({"command": _STR, "timeout_ms": {"type": "integer"}}, ["command"]),
        ),
        ToolSpec(
            "read",
            "Read a text file from the sandbox workspace.",
            _schema(
                {"path": _STR, "offset": {"type": "integer"}, "limit": {"type": "integer"}},
                ["path"],
            ),
        ),
        ToolSpec(
            "write",
            "Write a text file in the sandbox workspace (creates directories).",
            _schema({"path": _STR, "content": _STR}, ["path", "content"]),
        ),
        ToolSpec(
            "edit",
            "Replace one exact occurrence of old_string with new_string in a file.",
            _schema(
                {
                    "path": _STR,
                    "old_string": _STR,
                    "new_string": _STR,
                    "replace_all": {"type": "boolean"},
                },
                ["path", "old_string", "new_string"],
            ),
        ),
        ToolSpec(
            "glob",
            "List workspace files matching a glob pattern.",
            _schema({"pattern": _STR, "path": _STR}, ["pattern"]),
        ),
        ToolSpec(
            "grep",
            "Search workspace files for a regular expression.",
            _schema(
                {
                    "pattern": _STR,
                    "path": _STR,
                    "glob": _STR,
                    "ignore_case": {"type": "boolean"},
                    "files_with_matches": {"type": "boolean"},
                },
                ["pattern"],
            ),
        ),
    )
}


def is_sandbox_tool(name: str) -> bool:
    return name in SANDBOX_TOOLS


def complete(specs: Iterable[ToolSpec]) -> tuple[ToolSpec, ...]:
    """Fill in the description and schema of known sandbox tools named without one."""
    out = []
    for spec in specs:
        known = None if spec.custom else SANDBOX_TOOLS.get(spec.name)
        if known is not None and not spec.input_schema:
            spec = dataclasses.replace(
                spec,
                description=spec.description or known.description,
                input_schema=known.input_schema,
            )
        elif not spec.input_schema:
            spec = dataclasses.replace(spec, input_schema={"type": "object", "properties": {}})
        out.append(spec)
    return tuple(out)


def to_api(specs: Iterable[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "description": s.description or s.name,
            "input_schema": dict(s.input_schema),
        }
        for s in specs
    ]


# The Messages API's rule for tool names.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Server names that end at the first `__` of a namespaced name, so that name is unambiguous.
_PLAIN_SERVER = re.compile(r"^[A-Za-z0-9-]+(?:_[A-Za-z0-9-]+)*$")


def mcp_tool_name(server: str, tool: str) -> str:
    """The name the model sees for `tool` of MCP server `server`: `<server>__<tool>` when that
    is a valid tool name that only this pair produces; otherwise the same shape with invalid
    characters replaced and cut short, plus a hash of the pair (so distinct pairs stay
    distinct). A pure function of the pair, so a name read back from the log always maps to
    the same server and tool."""
    name = f"{server}__{tool}"
    if TOOL_NAME.match(name) and _PLAIN_SERVER.match(server):
        return name
    digest = hashlib.sha256(f"{server}\0{tool}".encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", name)[: 64 - 9]
    return f"{cleaned}_{digest}"
