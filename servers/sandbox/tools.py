"""The built-in tools as `GetCapabilities` advertises them: name, description, input schema.

The executor (`executor.py`) implements them; the proto's file comment is their contract.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]

    @property
    def input_schema_json(self) -> str:
        return json.dumps(self.input_schema, sort_keys=True)


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "Path relative to /workspace, or absolute inside it."}

TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "bash",
        "Run a command with /bin/bash -c in a fresh process in /workspace. Nothing but files "
        "carries over between calls (no variables, no cd, no background jobs). Output is "
        "stdout and stderr interleaved; a non-zero exit status is an error result.",
        _object(
            {
                "command": {"type": "string"},
                "timeout_ms": {"type": "integer", "minimum": 1, "maximum": 600000},
            },
            ["command"],
        ),
    ),
    ToolSpec(
        "read",
        "Read a text file as numbered lines (`<n>\\t<line>`), from line `offset` (1-based), "
        "at most `limit` lines (default 2000).",
        _object(
            {
                "path": _PATH,
                "offset": {"type": "integer", "minimum": 1},
                "limit": {"type": "integer", "minimum": 1},
            },
            ["path"],
        ),
    ),
    ToolSpec(
        "write",
        "Write a UTF-8 text file, creating parent directories and replacing any content.",
        _object({"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
    ),
    ToolSpec(
        "edit",
        "Replace the exact text `old_string` with `new_string` in a file. It must occur "
        "exactly once unless `replace_all` is true; otherwise the file is left unchanged.",
        _object(
            {
                "path": _PATH,
                "old_string": {"type": "string"},
                "new_string": {"type": "string"},
                "replace_all": {"type": "boolean"},
            },
            ["path", "old_string", "new_string"],
        ),
    ),
    ToolSpec(
        "glob",
        "List files matching a glob pattern (`**` for any depth) under `path`, most recently "
        "modified first.",
        _object({"pattern": {"type": "string"}, "path": _PATH}, ["pattern"]),
    ),
    ToolSpec(
        "grep",
        "Search files under `path` for a POSIX extended regular expression; prints "
        "`path:line:text`, or only paths with `files_with_matches`.",
        _object(
            {
                "pattern": {"type": "string"},
                "path": _PATH,
                "glob": {"type": "string", "description": "Only files whose name matches."},
                "ignore_case": {"type": "boolean"},
                "files_with_matches": {"type": "boolean"},
            },
            ["pattern"],
        ),
    ),
)
