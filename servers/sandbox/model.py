"""The sandbox domain: what a sandbox is, what it is asked to be, and how things fail.

Nothing here knows gRPC; the servicer converts to and from the `oma.sandbox.v1` messages.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
# No sandbox may ask for more CPU than the host has (the Docker engine refuses it anyway).
HOST_CPU_MILLIS = (os.cpu_count() or 1) * 1000

SESSION_LABEL = "oma.dev/session-id"
RESERVED_LABEL_PREFIX = "oma.dev/"
TOOL_NAMES = ("bash", "read", "write", "edit", "glob", "grep")
WORKSPACE = "/workspace"


class SandboxError(Exception):
    """A failure the contract names: `reason` is an `ErrorReason` name (no prefix)."""

    def __init__(self, reason: str, message: str, metadata: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata = metadata or {}


class SandboxState(enum.Enum):
    PROVISIONING = "provisioning"
    READY = "ready"
    TERMINATED = "terminated"


@dataclass(frozen=True)
class Resources:
    """Limits of one sandbox; zero means "the server's default" until `with_defaults`."""

    cpu_millis: int = 0
    memory_bytes: int = 0
    disk_bytes: int = 0
    pids: int = 0
    lifetime_seconds: float = 0.0
    idle_timeout_seconds: float = 0.0

    def with_defaults(self, defaults: Resources) -> Resources:
        return Resources(
            **{
                name: getattr(self, name) or getattr(defaults, name)
                for name in self.__dataclass_fields__
            }
        )


@dataclass(frozen=True)
class Limits:
    """What this server allows and fills in."""

    defaults: Resources = Resources(
        cpu_millis=1000,
        memory_bytes=1 * GiB,
        disk_bytes=10 * GiB,
        pids=512,
        lifetime_seconds=24 * 3600,
        idle_timeout_seconds=2 * 3600,
    )
    maximum: Resources = Resources(
        cpu_millis=HOST_CPU_MILLIS,
        memory_bytes=64 * GiB,
        disk_bytes=1024 * GiB,
        pids=32_768,
        lifetime_seconds=7 * 24 * 3600,
        idle_timeout_seconds=7 * 24 * 3600,
    )
    minimum_memory_bytes: int = 32 * MiB
    minimum_pids: int = 16
    max_output_bytes: int = 64 * 1024
    max_file_bytes: int = 100 * MiB
    default_timeout_ms: int = 120_000
    max_timeout_ms: int = 600_000
    stream_replay_bytes: int = 1 * MiB
    execution_record_seconds: int = 3600
    terminated_record_seconds: int = 3600

    def check(self, resources: Resources) -> None:
        for name in resources.__dataclass_fields__:
            value, cap = getattr(resources, name), getattr(self.maximum, name)
            if value < 0:
                raise SandboxError(
                    "INVALID_FIELD",
                    f"resources.{name} must not be negative",
                    {"field": f"resources.{name}"},
                )
            if value > cap:
                raise SandboxError(
                    "RESOURCES_EXCEED_LIMIT",
                    f"resources.{name}={value} exceeds this server's maximum of {cap}",
                    {"field": f"resources.{name}", "limit": str(cap)},
                )
        if 0 < resources.memory_bytes < self.minimum_memory_bytes:
            raise SandboxError(
                "INVALID_FIELD",
                f"resources.memory_bytes must be at least {self.minimum_memory_bytes}",
                {"field": "resources.memory_bytes"},
            )
        if 0 < resources.pids < self.minimum_pids:
            raise SandboxError(
                "INVALID_FIELD",
                f"resources.pids must be at least {self.minimum_pids}",
                {"field": "resources.pids"},
            )


@dataclass(frozen=True)
class GitRepository:
    url: str
    ref: str = ""
    path: str = ""
    credential_id: str = ""


@dataclass(frozen=True)
class InitFile:
    path: str
    content: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class SandboxSpec:
    """Everything `Provision` asks for (defaults not yet filled in)."""

    labels: dict[str, str] = field(default_factory=dict)
    resources: Resources = Resources()
    image: str = ""
    allowed_hosts: tuple[str, ...] = ()
    network_allow_list: bool = False
    repositories: tuple[GitRepository, ...] = ()
    files: tuple[InitFile, ...] = ()

    def fingerprint(self) -> str:
        """Identifies the request, to tell a retry from a reused request id."""
        data = asdict(self)
        data["files"] = [
            {**f, "content": hashlib.sha256(f["content"]).hexdigest()} for f in data["files"]
        ]
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class Sandbox:
    """A sandbox as the server knows it. Times are Unix seconds."""

    id: str
    labels: dict[str, str]
    state: SandboxState
    backend: str
    resources: Resources
    image: str
    allowed_hosts: tuple[str, ...]
    network_allow_list: bool
    create_time: float
    expire_time: float
    terminate_time: float = 0.0
    terminate_reason: str = ""
    request_id: str = ""
    fingerprint: str = ""

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        data["state"] = self.state.value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Sandbox:
        data = json.loads(text)
        data["state"] = SandboxState(data["state"])
        data["resources"] = Resources(**data["resources"])
        data["allowed_hosts"] = tuple(data["allowed_hosts"])
        return cls(**data)

    def copy(self) -> Sandbox:
        return replace(self, labels=dict(self.labels))


@dataclass(frozen=True)
class ExecutionResult:
    """One tool call's result, as `ExecuteResponse` carries it."""

    execution_id: str
    output: str
    is_error: bool
    exit_code: int
    timed_out: bool
    output_truncated: bool
    full_output_bytes: int
    full_output_path: str
    invalid_utf8_replaced: bool
    duration_seconds: float

    @classmethod
    def from_executor(cls, result: dict[str, Any]) -> ExecutionResult:
        return cls(
            execution_id=str(result["execution_id"]),
            output=str(result["output"]),
            is_error=bool(result["is_error"]),
            exit_code=int(result["exit_code"]),
            timed_out=bool(result["timed_out"]),
            output_truncated=bool(result["output_truncated"]),
            full_output_bytes=int(result["full_output_bytes"]),
            full_output_path=str(result["full_output_path"]),
            invalid_utf8_replaced=bool(result["invalid_utf8_replaced"]),
            duration_seconds=int(result.get("duration_ms", 0)) / 1000,
        )


@dataclass(frozen=True)
class StreamEvent:
    """One event of a streamed execution: `started`, `stdout`, `stderr` or `exited`."""

    kind: str
    execution_id: str
    name: str = ""
    reattached: bool = False
    data: bytes = b""
    offset: int = 0
    result: ExecutionResult | None = None
