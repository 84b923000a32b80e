"""What the loop needs from the session and sandbox services and MCP servers, as protocols.

`grpc_ports` implements them over the OMA contracts; the loop depends only on these, so it
never sees a stub, a status code or a protobuf message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from oma.servers.harness.events import Definition, Environment, LogEvent, McpServer, NewEvent


class LeaseHeld(Exception):
    """Another holder drives the session."""

    def __init__(self, holder_id: str) -> None:
        super().__init__(f"the session is driven by {holder_id or 'another harness'}")
        self.holder_id = holder_id


class LeaseLost(Exception):
    """Our fencing token is no longer valid: another harness owns the session now."""


class SessionGone(Exception):
    """The session does not exist or is terminated."""

    def __init__(self, message: str, *, terminated: bool) -> None:
        super().__init__(message)
        self.terminated = terminated


class Unreachable(Exception):
    """A service the harness depends on cannot be reached right now."""


class ToolFailed(Exception):
    """The sandbox service could not provision or run a tool; the model gets an error result."""


class SandboxGone(Exception):
    """The sandbox died or no longer exists; a new one must be provisioned."""


class McpUnavailable(Exception):
    """An MCP server could not be used: unreachable, refused by the vault's proxy, an HTTP
    error, or an MCP (JSON-RPC) error. The message says which, for a person or the model."""


@dataclass(frozen=True)
class McpTool:
    """A tool an MCP server lists (`tools/list`)."""

    server: str
    name: str
    description: str
    input_schema: Mapping[str, Any]
    # The server declares the tool read-only or idempotent (`annotations.readOnlyHint` /
    # `idempotentHint`): a call interrupted by a crash may be sent again.
    safe_to_repeat: bool = False


@dataclass(frozen=True)
class Lease:
    session_id: str
    holder_id: str
    fencing_token: Any
    ttl_seconds: float


@dataclass(frozen=True)
class ToolOutput:
    text: str
    is_error: bool


class SessionPort(Protocol):
    async def acquire_lease(self, session_id: str, holder_id: str, ttl_seconds: float) -> Lease:
        """Take the session's lease; raise `LeaseHeld` or `SessionGone`."""
        ...

    async def renew_lease(self, lease: Lease) -> Lease:
        """Extend the lease; raise `LeaseLost` when it is no longer ours."""
        ...

    async def release_lease(self, lease: Lease) -> None: ...

    async def definition(self, session_id: str) -> Definition: ...

    async def read_events(self, session_id: str, after_seq: int) -> list[LogEvent]:
        """Every stored event after `after_seq`, in seq order (all pages)."""
        ...

    async def append(self, lease: Lease, events: Sequence[NewEvent]) -> list[int]:
        """Append atomically under the lease and return the events' seqs (the original ones
        when the batch was already stored); raise `LeaseLost` when fenced out."""
        ...

    async def publish_preview(self, lease: Lease, after_seq: int, text: str) -> None: ...

    def follow(self, session_id: str, after_seq: int) -> AsyncIterator[LogEvent]:
        """Stored events after `after_seq`, then each one as it is appended (push)."""
        ...


class SandboxPort(Protocol):
    async def find_live(self, session_id: str) -> str | None:
        """A live sandbox labelled with this session, if there is one."""
        ...

    async def provision(
        self, session_id: str, request_id: str, environment: Environment
    ) -> str: ...

    async def execute(
        self, sandbox_id: str, name: str, tool_input: Mapping[str, Any], execution_id: str
    ) -> ToolOutput:
        """Run a tool; raise `SandboxGone` when the sandbox is dead or unknown, `ToolFailed`
        when the service fails otherwise."""
        ...

    async def destroy(self, sandbox_id: str) -> None:
        """Best-effort, idempotent teardown of a sandbox found dead."""
        ...


class McpConnection(Protocol):
    """The MCP servers of one session, for one turn (it may keep MCP sessions open)."""

    async def list_tools(self, server: McpServer) -> list[McpTool]:
        """Every tool the server lists; raise `McpUnavailable`."""
        ...

    async def call_tool(
        self, server: McpServer, tool: str, arguments: Mapping[str, Any]
    ) -> ToolOutput:
        """Call a tool once: its result (an `is_error` one when the tool failed); raise
        `McpUnavailable` when the call could not be made or the server answered an error."""
        ...

    async def close(self) -> None: ...


class McpPort(Protocol):
    def connect(self, session_id: str, definition: Definition) -> McpConnection:
        """A connection to the session's MCP servers, with the credentials its definition
        grants (a vault session token, obtained when first needed)."""
        ...
