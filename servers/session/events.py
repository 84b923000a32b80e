"""Rules about events that need no storage: type names, who may write what, batch checks.

An event's dotted type follows from its payload field (`user_message` → `user.message`), so
the two can never disagree ([SESSION-EVENT-001]).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from oma.servers.session.errors import InvalidArgument
from oma.session.v1 import definition_pb2, events_pb2

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")

BUILTIN_TOOLS = frozenset({"bash", "read", "write", "edit", "glob", "grep"})


def type_of_field(field_name: str) -> str:
    """`span_model_request_end` → `span.model_request_end`."""
    return field_name.replace("_", ".", 1)


PAYLOAD_FIELDS: tuple[str, ...] = tuple(
    f.name for f in events_pb2.Event.DESCRIPTOR.oneofs_by_name["payload"].fields
)
TYPE_OF_FIELD: dict[str, str] = {f: type_of_field(f) for f in PAYLOAD_FIELDS}
ALL_TYPES: frozenset[str] = frozenset(TYPE_OF_FIELD.values())
SERVER_TYPES = frozenset({"session.created"})
CLIENT_TYPES = frozenset(t for t in ALL_TYPES if t.startswith("user."))
HARNESS_TYPES = ALL_TYPES - CLIENT_TYPES - SERVER_TYPES
TOOL_USE_TYPES = frozenset(
    {
        "agent.tool_use",
        "agent.tool_result",
        "agent.mcp_tool_use",
        "agent.mcp_tool_result",
        "agent.custom_tool_use",
        "user.tool_confirmation",
        "user.custom_tool_result",
    }
)
_JSON_INPUT_FIELDS = {
    "agent_tool_use": "input_json",
    "agent_mcp_tool_use": "input_json",
    "agent_custom_tool_use": "input_json",
}

# Types whose payload has more to check than its presence.
_CHECKED_TYPES = TOOL_USE_TYPES | {
    "agent.tool_use",
    "agent.mcp_tool_use",
    "agent.custom_tool_use",
    "session.status_idle",
    "user.tool_confirmation",
    "user.message",
    "agent.message",
}

# Status codes as stored in the sessions table; equal to oma.session.v1.SessionStatus values.
STATUS_RUNNING = 1
STATUS_IDLE = 2
STATUS_RESCHEDULING = 3
STATUS_TERMINATED = 4
STATUS_OF_TYPE = {
    "session.status_running": STATUS_RUNNING,
    "session.status_idle": STATUS_IDLE,
    "session.status_rescheduled": STATUS_RESCHEDULING,
    "session.status_terminated": STATUS_TERMINATED,
}


@dataclass(frozen=True)
class Limits:
    """Numeric limits, advertised through GetCapabilities under `session.*` names."""

    max_event_bytes: int = 1 << 20
    max_batch_events: int = 1000
    max_batch_bytes: int = 3 << 20
    max_lease_ttl_ms: int = 10 * 60 * 1000
    max_preview_bytes: int = 4096
    # Not advertised: GetEvents pages stop here, below the server's message size.
    max_page_bytes: int = 8 << 20

    def as_capabilities(self) -> dict[str, int]:
        return {
            f"session.{name}": value
            for name, value in self.__dict__.items()
            if name != "max_page_bytes"
        }


@dataclass
class PreparedBatch:
    """A validated batch and what storing it does to the session row, folded in advance so
    the store's transaction only has to offset indexes by the allocated seq. `bodies[i]` is
    event i serialized without its seq and create_time, which the store appends as wire
    fields once it has allocated them."""

    ids: list[str]
    types: list[str]
    bodies: list[bytes]
    needs_lease: bool
    last_client_index: int = -1  # index of the last user.* event, -1 if none
    last_status_index: int = -1  # index of the last session.status_* event, -1 if none
    last_status: int = 0
    last_idle_index: int = -1
    last_stop_reason: int = 0


def check_id(value: str, field: str, reason: str = "INVALID_FIELD") -> None:
    if not ID_PATTERN.match(value):
        raise InvalidArgument(
            reason,
            f"{field} must be 1-128 characters of [A-Za-z0-9._-], got {value[:140]!r}",
            field=field,
        )


def _type_field(event_type: str) -> bytes:
    """`type` (field 4 of Event) as wire bytes."""
    raw = event_type.encode()
    assert len(raw) < 0x80
    return b"\x22" + bytes((len(raw),)) + raw


# What the append loop needs per payload field, looked up once per event:
# (type, kind, the type as wire bytes, whether the payload has more to check than presence).
_CLIENT, _HARNESS, _SERVER = 0, 1, 2
_FIELD_INFO: dict[str | None, tuple[str, int, bytes, bool]] = {
    field: (
        event_type,
        _CLIENT
        if event_type in CLIENT_TYPES
        else _SERVER
        if event_type in SERVER_TYPES
        else _HARNESS,
        _type_field(event_type),
        event_type in _CHECKED_TYPES,
    )
    for field, event_type in TYPE_OF_FIELD.items()
}
# Payloads whose only extra check is non-empty content (the common case, checked inline).
_CONTENT_FIELDS = frozenset({"user_message", "agent_message"})


def prepare_batch(
    events: Sequence[events_pb2.Event], *, may_write_harness_events: bool, limits: Limits
) -> PreparedBatch:
    """Validate a batch before any storage is touched ([SESSION-APPEND-001]) and derive each
    event's type. Raises InvalidArgument; nothing is stored by this function."""
    if not events:
        raise InvalidArgument("INVALID_FIELD", "events is empty: send 1 or more", field="events")
    count = len(events)
    if count > limits.max_batch_events:
        raise InvalidArgument(
            "BATCH_TOO_LARGE",
            f"the batch holds {count} events; the limit (session.max_batch_events) is "
            f"{limits.max_batch_events}: split it",
            field="events",
            limit=str(limits.max_batch_events),
        )
    # This function is on the hot path of every append: the id checks run over the whole
    # batch at C speed, and error texts are built only when an error is raised.
    ids = [event.id for event in events]
    if not all(map(ID_PATTERN.match, ids)):
        for index, event_id in enumerate(ids):
            check_id(event_id, f"events[{index}].id", "INVALID_EVENT_ID")
    if len(set(ids)) != count:
        seen: set[str] = set()
        for index, event_id in enumerate(ids):
            if event_id in seen:
                raise InvalidArgument(
                    "INVALID_FIELD",
                    f"events[{index}].id {event_id!r} appears twice in the batch; ids are "
                    "unique per session",
                    field=f"events[{index}].id",
                )
            seen.add(event_id)
    types: list[str] = []
    bodies: list[bytes] = []
    max_event_bytes = limits.max_event_bytes
    total = 0
    needs_lease = False
    last_client_index = last_status_index = last_idle_index = -1
    last_status = last_stop_reason = 0
    last = count - 1
    for index, event in enumerate(events):
        # Output-only fields are the server's. When a writer sent none of them (the common
        # case) the event is serialized once, its size is that serialization's, and the type
        # is appended to it as a wire field (parsers take fields in any order).
        clean = not (event.seq or event.type or event.HasField("create_time"))
        raw = event.SerializeToString() if clean else b""
        size = len(raw) if clean else event.ByteSize()
        if size > max_event_bytes:
            raise InvalidArgument(
                "EVENT_TOO_LARGE",
                f"events[{index}] is {size} bytes; the limit (session.max_event_bytes) is "
                f"{max_event_bytes}",
                field=f"events[{index}]",
                limit=str(max_event_bytes),
            )
        total += size
        field = event.WhichOneof("payload")
        info = _FIELD_INFO.get(field)
        if info is None:
            raise InvalidArgument(
                "INVALID_EVENT",
                f"events[{index}] has no payload: set exactly one",
                field=f"events[{index}]",
            )
        assert field is not None
        event_type, kind, type_wire, checked = info
        if kind == _CLIENT:
            last_client_index = index
        elif kind == _HARNESS:
            if not may_write_harness_events:
                raise InvalidArgument(
                    "INVALID_EVENT",
                    f"events[{index}] is {event_type}, a harness event; a client may append "
                    "only user.* events",
                    field=f"events[{index}]",
                )
            needs_lease = True
            status = STATUS_OF_TYPE.get(event_type)
            if status is not None:
                if status == STATUS_TERMINATED and index != last:
                    raise InvalidArgument(
                        "INVALID_EVENT",
                        f"events[{index}] is session.status_terminated, which must be the last "
                        "event of its batch: nothing can follow it",
                        field=f"events[{index}]",
                    )
                last_status_index, last_status = index, status
                if status == STATUS_IDLE:
                    last_idle_index = index
                    last_stop_reason = event.session_status_idle.stop_reason
        else:
            raise InvalidArgument(
                "INVALID_EVENT",
                f"events[{index}] is {event_type}, which only CreateSession writes",
                field=f"events[{index}]",
            )
        if field in _CONTENT_FIELDS:
            # _check_payload's rules for these payloads, inline; it raises the precise error.
            if event.tool_use_id or len(event.turn_id) > 256 or not getattr(event, field).content:
                _check_payload(event, field, event_type, f"events[{index}]")
        elif checked or event.tool_use_id or event.turn_id:
            _check_payload(event, field, event_type, f"events[{index}]")
        if clean:
            bodies.append(raw + type_wire)
        else:
            event.seq = 0
            event.ClearField("create_time")
            event.type = event_type
            bodies.append(event.SerializeToString())
        types.append(event_type)
    if total > limits.max_batch_bytes:
        raise InvalidArgument(
            "BATCH_TOO_LARGE",
            f"the batch is {total} bytes; the limit (session.max_batch_bytes) is "
            f"{limits.max_batch_bytes}: split it",
            field="events",
            limit=str(limits.max_batch_bytes),
        )
    return PreparedBatch(
        ids,
        types,
        bodies,
        needs_lease,
        last_client_index,
        last_status_index,
        last_status,
        last_idle_index,
        last_stop_reason,
    )


def _check_payload(event: events_pb2.Event, field: str, event_type: str, where: str) -> None:
    if event_type in TOOL_USE_TYPES:
        if not event.tool_use_id:
            raise InvalidArgument(
                "INVALID_EVENT",
                f"{where} is {event_type} and needs tool_use_id (the model's tool use id)",
                field=f"{where}.tool_use_id",
            )
    elif event.tool_use_id:
        raise InvalidArgument(
            "INVALID_EVENT",
            f"{where} is {event_type}, which carries no tool_use_id; leave it empty",
            field=f"{where}.tool_use_id",
        )
    if len(event.tool_use_id) > 256 or len(event.turn_id) > 256:
        raise InvalidArgument(
            "INVALID_EVENT",
            f"{where}: turn_id and tool_use_id are at most 256 characters",
            field=where,
        )
    payload = getattr(event, field)
    if field in _JSON_INPUT_FIELDS:
        text = getattr(payload, _JSON_INPUT_FIELDS[field])
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise InvalidArgument(
                "INVALID_EVENT",
                f"{where}.{field}.input_json is not JSON: {exc}",
                field=f"{where}.{field}.input_json",
            ) from None
        if not isinstance(value, dict):
            raise InvalidArgument(
                "INVALID_EVENT",
                f"{where}.{field}.input_json must be a JSON object",
                field=f"{where}.{field}.input_json",
            )
    if field == "session_status_idle" and payload.stop_reason == 0:
        raise InvalidArgument(
            "INVALID_EVENT",
            f"{where}.session_status_idle.stop_reason must be set",
            field=f"{where}.session_status_idle.stop_reason",
        )
    if field == "user_tool_confirmation" and payload.result == 0:
        raise InvalidArgument(
            "INVALID_EVENT",
            f"{where}.user_tool_confirmation.result must be ALLOW or DENY",
            field=f"{where}.user_tool_confirmation.result",
        )
    if field in ("user_message", "agent_message") and not payload.content:
        raise InvalidArgument(
            "INVALID_EVENT",
            f"{where}.{field}.content needs at least one block",
            field=f"{where}.{field}.content",
        )


def check_definition(definition: definition_pb2.SessionDefinition) -> None:
    """What CreateSession can check alone. Raises InvalidArgument naming the field."""
    prefix = "definition"
    if not definition.model.strip():
        raise InvalidArgument(
            "INVALID_FIELD",
            "definition.model is required, e.g. claude-sonnet-4-5",
            field=f"{prefix}.model",
        )
    names: set[str] = set()
    for i, tool in enumerate(definition.tools):
        if tool.name not in BUILTIN_TOOLS:
            raise InvalidArgument(
                "INVALID_FIELD",
                f"definition.tools[{i}].name {tool.name!r} is not a built-in tool; use one of "
                f"{', '.join(sorted(BUILTIN_TOOLS))} (or declare it under custom_tools)",
                field=f"{prefix}.tools[{i}].name",
            )
        _unique(names, tool.name, f"{prefix}.tools[{i}].name")
    for i, custom in enumerate(definition.custom_tools):
        where = f"{prefix}.custom_tools[{i}]"
        if not _TOOL_NAME.match(custom.name):
            raise InvalidArgument(
                "INVALID_FIELD",
                f"{where}.name must be 1-64 characters of [A-Za-z0-9_-]",
                field=f"{where}.name",
            )
        _unique(names, custom.name, f"{where}.name")
        if custom.input_schema_json:
            try:
                schema = json.loads(custom.input_schema_json)
            except ValueError as exc:
                raise InvalidArgument(
                    "INVALID_FIELD",
                    f"{where}.input_schema_json is not JSON: {exc}",
                    field=f"{where}.input_schema_json",
                ) from None
            if not isinstance(schema, dict):
                raise InvalidArgument(
                    "INVALID_FIELD",
                    f"{where}.input_schema_json must be a JSON object",
                    field=f"{where}.input_schema_json",
                )
    servers: set[str] = set()
    for i, server in enumerate(definition.mcp_servers):
        where = f"{prefix}.mcp_servers[{i}]"
        if not server.name:
            raise InvalidArgument(
                "INVALID_FIELD", f"{where}.name is required", field=f"{where}.name"
            )
        _unique(servers, server.name, f"{where}.name")
        if not server.url.startswith(("http://", "https://")):
            raise InvalidArgument(
                "INVALID_FIELD", f"{where}.url must be an http(s) URL", field=f"{where}.url"
            )
    for i, repo in enumerate(definition.environment.repositories):
        if not repo.url:
            raise InvalidArgument(
                "INVALID_FIELD",
                f"{prefix}.environment.repositories[{i}].url is required",
                field=f"{prefix}.environment.repositories[{i}].url",
            )
    for i, file in enumerate(definition.environment.files):
        if not file.path:
            raise InvalidArgument(
                "INVALID_FIELD",
                f"{prefix}.environment.files[{i}].path is required",
                field=f"{prefix}.environment.files[{i}].path",
            )
    for key, value in definition.labels.items():
        if not key or len(key) > 256 or len(value) > 256:
            raise InvalidArgument(
                "INVALID_FIELD",
                f"definition.labels[{key[:40]!r}]: keys (non-empty) and values are at most 256 "
                "characters",
                field=f"{prefix}.labels",
            )


def _unique(seen: set[str], name: str, field: str) -> None:
    if name in seen:
        raise InvalidArgument("INVALID_FIELD", f"{field} {name!r} is declared twice", field=field)
    seen.add(name)
