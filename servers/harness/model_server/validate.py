"""Request validation as strict as the real Messages API.

Two layers. First the body is checked against the `anthropic` SDK's own request
TypedDicts (`MessageCreateParamsNonStreaming` / `...Streaming`, `MessageCountTokensParams`),
compiled with three changes so that they judge a JSON body the way the API does:
`Iterable[...]` fields become lists (pydantic validates iterables lazily, so errors would
otherwise go unnoticed), unknown keys are rejected (`extra="forbid"`), and the SDK's
response models (`TextBlock`, ...), which it accepts only as a Python convenience, are removed
from unions. Then the conversation rules that no type can express: roles alternate starting
with `user`, every `tool_result` answers a `tool_use` of the immediately preceding assistant
message and every such `tool_use` is answered, tool names are unique, at most four
`cache_control` breakpoints, no empty text blocks.

Every failure raises `InvalidRequest` with a message modelled on the real API's wording.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError
from pydantic_core import SchemaValidator

MAX_CACHE_BREAKPOINTS = 4
MIN_THINKING_BUDGET = 1024


class InvalidRequest(Exception):
    """A request the real API would refuse with HTTP 400 `invalid_request_error`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _is_model_choice(choice: Any, defs: Mapping[str, Any]) -> bool:
    schema = choice[0] if isinstance(choice, tuple) else choice
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "definition-ref":
        schema = defs.get(schema.get("schema_ref", ""), {})
    if schema.get("type") == "model":
        return True
    if schema.get("type") == "union":
        return all(_is_model_choice(c, defs) for c in schema["choices"])
    return False


def _tag_values(choice: Any, defs: Mapping[str, Any], discriminator: str) -> list[str] | None:
    schema = choice[0] if isinstance(choice, tuple) else choice
    if schema.get("type") == "definition-ref":
        schema = defs.get(schema.get("schema_ref", ""), {})
    if schema.get("type") != "typed-dict":
        return None
    tag = schema["fields"].get(discriminator)
    if not tag or not tag.get("required") or tag["schema"].get("type") != "literal":
        return None
    values = tag["schema"]["expected"]
    return values if all(isinstance(v, str) for v in values) else None


def _as_tagged_union(node: dict[str, Any], defs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The union as a tagged union on `type` (or `role`) when every member has that tag.

    Tagged unions report an unknown tag precisely ("Input tag 'x' found using 'type' does
    not match any of the expected tags: ...", the real API's own wording) instead of every
    member's complaint.
    """
    for discriminator in ("type", "role"):
        choices: dict[str, Any] = {}
        for choice in node["choices"]:
            values = _tag_values(choice, defs, discriminator)
            if values is None or any(v in choices for v in values):
                break
            for value in values:
                choices[value] = choice[0] if isinstance(choice, tuple) else choice
        else:
            return {"type": "tagged-union", "choices": choices, "discriminator": discriminator}
    return None


def _tighten(node: Any, defs: Mapping[str, Any]) -> Any:
    """Rewrite a pydantic core schema in place into the strict JSON form (see module doc)."""
    if isinstance(node, list):
        for item in node:
            _tighten(item, defs)
        return node
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "generator":
        node["type"] = "list"
    elif kind == "typed-dict":
        node["extra_behavior"] = "forbid"
    elif kind == "union":
        kept = [c for c in node["choices"] if not _is_model_choice(c, defs)]
        if kept:
            node["choices"] = kept
        tagged = _as_tagged_union(node, defs)
        if tagged is not None:
            node.clear()
            node.update(tagged)
    for key, value in node.items():
        if key in ("cls", "function", "metadata", "config"):
            continue
        _tighten(value, defs)
    return node


@functools.cache
def _validator(kind: str) -> SchemaValidator:
    from anthropic.types import message_count_tokens_params, message_create_params

    target: Any = {
        "create": message_create_params.MessageCreateParamsNonStreaming,
        "stream": message_create_params.MessageCreateParamsStreaming,
        "count_tokens": message_count_tokens_params.MessageCountTokensParams,
    }[kind]
    schema = copy.deepcopy(TypeAdapter(target).core_schema)
    defs = {d["ref"]: d for d in schema.get("definitions", []) if "ref" in d}
    return SchemaValidator(_tighten(schema, defs))


def _location(loc: tuple[int | str, ...]) -> str:
    # pydantic names union members in locations (e.g. `UserMessageParam`), and the role tag
    # of a message (`messages.0.user.content`); the API shows neither.
    parts: list[str] = []
    for i, p in enumerate(loc):
        if isinstance(p, str) and (p[:1].isupper() or "[" in p):
            continue
        if i >= 2 and loc[i - 2] == "messages" and isinstance(loc[i - 1], int):
            continue
        parts.append(str(p))
    return ".".join(parts)


def _schema_error(exc: ValidationError) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    # The deepest location is the most specific explanation of a failed union.
    first = max(errors, key=lambda e: len(e["loc"]))
    where = _location(first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "Extra inputs are not permitted"
    elif first["type"] == "missing":
        msg = "Field required"
    return InvalidRequest(f"{where}: {msg}" if where else msg)


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)


def _count_cache_control(body: Mapping[str, Any]) -> int:
    count = 1 if body.get("cache_control") else 0
    count += sum(1 for tool in body.get("tools") or [] if tool.get("cache_control"))
    system = body.get("system")
    if isinstance(system, list):
        count += sum(1 for block in system if block.get("cache_control"))
    for message in body["messages"]:
        if isinstance(message["content"], list):
            count += sum(1 for block in message["content"] if block.get("cache_control"))
    return count


def _check_conversation(body: Mapping[str, Any]) -> None:
    messages = body["messages"]
    if not messages:
        raise InvalidRequest("messages: at least one message is required")
    if messages[0]["role"] != "user":
        raise InvalidRequest('messages: first message must use the "user" role')
    last = len(messages) - 1
    for i, message in enumerate(messages):
        role = message["role"]
        if role not in ("user", "assistant"):
            raise InvalidRequest(
                f'messages.{i}.role: unexpected role "{role}"; the system prompt goes in the '
                "top-level `system` parameter"
            )
        if i > 0 and messages[i - 1]["role"] == role:
            raise InvalidRequest(
                f'messages.{i}: roles must alternate between "user" and "assistant", but found '
                f'multiple "{role}" roles in a row'
            )
        blocks = _blocks(message["content"])
        if not blocks and not (i == last and role == "assistant"):
            raise InvalidRequest(
                f"messages.{i}: all messages must have non-empty content except for the "
                "optional final assistant message"
            )
        for j, block in enumerate(blocks):
            if block.get("type") == "text" and not block.get("text"):
                raise InvalidRequest(
                    f"messages.{i}.content.{j}: text content blocks must be non-empty"
                )
    final = _blocks(messages[last]["content"])
    if messages[last]["role"] == "assistant" and final and final[-1].get("type") == "text":
        if final[-1]["text"] != final[-1]["text"].rstrip():
            raise InvalidRequest("final assistant content cannot end with trailing whitespace")
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        tool_use_ids = [b["id"] for b in _blocks(message["content"]) if b.get("type") == "tool_use"]
        if len(set(tool_use_ids)) != len(tool_use_ids):
            raise InvalidRequest(f"messages.{i}: `tool_use` ids must be unique")
        answered: set[str] = set()
        if i < last:
            for block in _blocks(messages[i + 1]["content"]):
                if block.get("type") == "tool_result":
                    answered.add(block["tool_use_id"])
        missing = [t for t in tool_use_ids if t not in answered]
        if missing:
            raise InvalidRequest(
                f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
                "corresponding `tool_result` block in the next message."
            )
    for i, message in enumerate(messages):
        if message["role"] != "user":
            continue
        previous = _blocks(messages[i - 1]["content"]) if i > 0 else []
        offered = {b["id"] for b in previous if b.get("type") == "tool_use"}
        for j, block in enumerate(_blocks(message["content"])):
            if block.get("type") == "tool_result" and block["tool_use_id"] not in offered:
                raise InvalidRequest(
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                    f"blocks: {block['tool_use_id']}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )


def _check_tools(body: Mapping[str, Any]) -> None:
    names = [tool.get("name") for tool in body.get("tools") or []]
    duplicates = sorted({n for n in names if names.count(n) > 1 and n is not None})
    if duplicates:
        raise InvalidRequest(
            f"tools: Tool names must be unique (duplicated: {', '.join(duplicates)})"
        )
    choice = body.get("tool_choice")
    if (
        isinstance(choice, Mapping)
        and choice.get("type") == "tool"
        and choice.get("name") not in names
    ):
        raise InvalidRequest(f"tool_choice.name: no tool named {choice.get('name')!r} in `tools`")


def _check_thinking(body: Mapping[str, Any]) -> None:
    thinking = body.get("thinking")
    if not isinstance(thinking, Mapping) or thinking.get("type") != "enabled":
        return
    budget = thinking["budget_tokens"]
    if budget < MIN_THINKING_BUDGET:
        raise InvalidRequest(
            "thinking.enabled.budget_tokens: Input should be greater than or equal to "
            f"{MIN_THINKING_BUDGET}"
        )
    if "max_tokens" in body and body["max_tokens"] <= budget:
        raise InvalidRequest("`max_tokens` must be greater than `thinking.budget_tokens`")


def validate_request(body: Any, *, kind: str) -> dict[str, Any]:
    """Validate a decoded JSON body; `kind` is `create`, `stream` or `count_tokens`.

    Returns the body (as sent, plain JSON values) when it is acceptable.
    Raises `InvalidRequest` otherwise.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    try:
        _validator(kind).validate_python(body)
    except ValidationError as exc:
        raise _schema_error(exc) from None
    if kind != "count_tokens" and body["max_tokens"] < 1:
        raise InvalidRequest("max_tokens: Input should be greater than or equal to 1")
    _check_conversation(body)
    _check_tools(body)
    _check_thinking(body)
    breakpoints = _count_cache_control(body)
    if breakpoints > MAX_CACHE_BREAKPOINTS:
        raise InvalidRequest(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {breakpoints}."
        )
    return body


def warm_up() -> None:
    """Compile the validators now (about a second) rather than on the first request."""
    for kind in ("create", "stream", "count_tokens"):
        _validator(kind)
