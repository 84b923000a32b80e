"""The harness's own view of session events, free of protobuf.

The loop reads `LogEvent`s and writes `NewEvent`s; `grpc_ports` converts them to and from
`oma.session.v1` messages, so the loop can be read (and tested) without the wire format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Event type names (the Managed Agents names the session contract uses).
USER_MESSAGE = "user.message"
USER_INTERRUPT = "user.interrupt"
USER_TOOL_CONFIRMATION = "user.tool_confirmation"
USER_CUSTOM_TOOL_RESULT = "user.custom_tool_result"
AGENT_MESSAGE = "agent.message"
AGENT_TOOL_USE = "agent.tool_use"
AGENT_TOOL_RESULT = "agent.tool_result"
AGENT_CUSTOM_TOOL_USE = "agent.custom_tool_use"
AGENT_MCP_TOOL_USE = "agent.mcp_tool_use"
AGENT_MCP_TOOL_RESULT = "agent.mcp_tool_result"
STATUS_RUNNING = "session.status_running"
STATUS_IDLE = "session.status_idle"
STATUS_RESCHEDULED = "session.status_rescheduled"
STATUS_TERMINATED = "session.status_terminated"
SESSION_ERROR = "session.error"
SPAN_START = "span.model_request_start"
SPAN_END = "span.model_request_end"

# Stop reasons of `session.status_idle`.
STOP_END_TURN = "end_turn"
STOP_REQUIRES_ACTION = "requires_action"
STOP_RETRIES_EXHAUSTED = "retries_exhausted"
STOP_BUDGET_REACHED = "budget_reached"


@dataclass(frozen=True)
class Usage:
    """Token usage of one model request."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @property
    def total(self) -> int:
        """Every token the call consumed: input (cached or not) plus output."""
        return (
            self.input_tokens
            + self.cache_read_input_tokens
            + self.cache_creation_input_tokens
            + self.output_tokens
        )


@dataclass(frozen=True)
class ToolSpec:
    """A tool the session's model may call.

    `custom` tools are run by the client (`agent.custom_tool_use`, answered by a
    `user.custom_tool_result`); the others by the sandbox. `ask` means each call waits for a
    `user.tool_confirmation` (permission policy "always ask")."""

    name: str
    description: str = ""
    input_schema: Mapping[str, Any] = field(default_factory=dict)
    custom: bool = False
    ask: bool = False


@dataclass(frozen=True)
class Environment:
    """What a sandbox for the session is provisioned with (zero values: server defaults)."""

    image: str = ""
    cpu_millis: int = 0
    memory_bytes: int = 0
    disk_bytes: int = 0
    pids: int = 0
    lifetime_seconds: float = 0.0
    allowed_hosts: tuple[str, ...] = ()
    # (path, content, mode) written into the workspace at provision time.
    files: tuple[tuple[str, bytes, int], ...] = ()
    # (url, ref, path, vault credential id) cloned into the workspace at provision time.
    repositories: tuple[tuple[str, str, str, str], ...] = ()


@dataclass(frozen=True)
class McpServer:
    """An MCP server of the session (`SessionDefinition.mcp_servers`): its tools are offered
    to the model as `<name>__<tool>`, called through the vault's proxy with `credential_id`
    injected (directly when it is empty)."""

    name: str
    url: str
    credential_id: str = ""
    ask: bool = False


@dataclass(frozen=True)
class Definition:
    """What the harness needs from a session's definition."""

    model: str
    system: str = ""
    tools: tuple[ToolSpec, ...] = ()
    max_tokens: int = 4096
    # Budgets (`SessionDefinition.budgets`); 0 means no limit beyond the harness's defaults.
    max_output_tokens_per_turn: int = 0
    max_total_tokens: int = 0
    max_model_calls_per_turn: int = 0
    max_turns: int = 0
    environment: Environment = Environment()
    mcp_servers: tuple[McpServer, ...] = ()
    # `SessionDefinition.vault_credential_ids`: what a vault session token may grant.
    vault_credential_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class LogEvent:
    """One stored event, as the harness reads it."""

    seq: int
    id: str
    type: str
    text: str = ""
    tool_use_id: str = ""
    tool_name: str = ""
    tool_input: Mapping[str, Any] = field(default_factory=dict)
    is_error: bool = False
    stop_reason: str = ""
    usage: Usage = Usage()
    # `user.tool_confirmation`: whether the call may run (`text` carries a deny message).
    allowed: bool = False
    # `agent.mcp_tool_use`: the server and the tool's own name (`tool_name` is the name the
    # model used, `<server>__<tool>`).
    mcp_server: str = ""
    mcp_tool: str = ""


@dataclass(frozen=True)
class NewEvent:
    """One event the harness appends; `id` is deterministic so a retried append is a no-op."""

    id: str
    type: str
    turn_id: str = ""
    text: str = ""
    tool_use_id: str = ""
    tool_name: str = ""
    tool_input: Mapping[str, Any] = field(default_factory=dict)
    is_error: bool = False
    stop_reason: str = ""
    usage: Usage = Usage()
    model: str = ""
    # `session.status_idle` with `requires_action`: the calls waiting for the user.
    tool_use_ids: tuple[str, ...] = ()
    # `session.error`: a stable kind and whether the harness retries on its own.
    code: str = ""
    retrying: bool = False
    # `agent.mcp_tool_use`: the server and the tool's own name.
    mcp_server: str = ""
    mcp_tool: str = ""
