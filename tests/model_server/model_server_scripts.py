"""Scripts and tools the model server tests play (shared by the test modules)."""

from __future__ import annotations

from typing import Any

TOOLS: list[dict[str, Any]] = [
    {
        "name": "write",
        "description": "Write a file.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
        },
    },
    {
        "name": "bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
]

SCRIPTS: dict[str, Any] = {
    "scripts": {
        "chat": {
            "turns": [
                {"text": "Hello! How can I help?"},
                {"text": "Goodbye.", "usage": {"output_tokens": 7}},
            ]
        },
        "tools": {
            "turns": [
                {
                    "content": [
                        {"type": "text", "text": "Writing the file."},
                        {
                            "type": "tool_use",
                            "name": "write",
                            "input": {"path": "a.py", "content": "print(1)"},
                        },
                        {"type": "tool_use", "name": "bash", "input": {"command": "ls"}},
                    ]
                },
                {
                    "content": [
                        {"type": "tool_use", "name": "bash", "input": {"command": "python3 a.py"}}
                    ],
                },
                {"text": "It printed 1."},
            ]
        },
        "thinking": {
            "turns": [
                {
                    "content": [
                        {"type": "thinking", "thinking": "The user wants a number. " * 4},
                        {"type": "text", "text": "Forty-two."},
                    ]
                }
            ]
        },
        "flaky": {
            "turns": [
                {
                    "fail": {
                        "error": {
                            "status": 529,
                            "type": "overloaded_error",
                            "message": "Overloaded",
                        },
                        "times": 2,
                    },
                    "text": "Served at last.",
                }
            ]
        },
        "slow": {"turns": [{"text": "Slow hello.", "ttft_ms": 300}]},
        "truncated": {"turns": [{"text": "Cut off", "stop_reason": "max_tokens"}]},
    },
    "default": "chat",
}

MODEL = "claude-scripted"
