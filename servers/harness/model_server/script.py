"""Scripts: what the scripted model answers, turn by turn.

A script file is JSON (or YAML when PyYAML is installed) in one of three shapes:

* a list of turns: one script, named after the file (and also the default);
* `{"name": "demo", "turns": [...]}`: one named script;
* `{"scripts": {"demo": {"turns": [...]}, "other": [...]}, "default": "demo"}`: several.

A turn is an object::

    {
      "content": [                                  # the assistant message, in order
        {"type": "thinking", "thinking": "..."},    # signature optional (deterministic)
        {"type": "text", "text": "Let me write it."},
        {"type": "tool_use", "name": "write", "input": {"path": "a.py", "content": "..."}}
      ],
      "stop_reason": "tool_use",    # end_turn | tool_use | max_tokens | stop_sequence;
                                    # default: tool_use if a tool_use block is present, else end_turn
      "usage": {"output_tokens": 42},  # optional; overrides the estimated counts it names
      "ttft_ms": 250,               # optional; this turn's time to first token, overrides the server's
      "fail": {"error": {"status": 529, "type": "overloaded_error"}, "times": 2}
                                    # optional (object or list): answer the first `times` requests
                                    # for this turn of a conversation with this error, then serve it.
                                    # Optional in a failure: "retry_after": SECONDS (header), and
                                    # "mid_stream": true (a streaming request gets the start of the
                                    # reply and then an SSE `error` event, as the real API does
                                    # when it overloads mid-reply)
    }

The shorthand `"text": "..."` stands for a single text block.

Which turn is played: the one after the turn that produced the request's most recent
assistant message, which the server recognises by the tool-use ids and text it served
(`turns.py`), so a client that trims old events from its history still gets the next turn.
A message the server has no record of (a fresh server, a hand-written history) falls back to
position: turn N (0-based) answers a request whose `messages` hold N assistant messages (a
trailing assistant prefill is not counted). Either way the choice depends on the request and
on what was served, never on how often: a harness that crashes and retries the same request
gets the same answer, and concurrent conversations never interfere. Tool-use ids are derived from the conversation key
(`metadata.user_id`, else the text of the first user message), the script name, the turn and
the block index, so a replay produces the same ids.

Which script is played: a `[script:NAME]` marker in the system prompt (or the first user
message) wins; then a `metadata.user_id` of the form `NAME` or `NAME:anything`; then the default
script (`"default"` in the file, else a script named `default`, else the only script).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STOP_REASONS = ("end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal")
BLOCK_TYPES = ("text", "tool_use", "thinking")
MARKER = re.compile(r"\[script:([A-Za-z0-9_.\-]+)\]")


class ScriptError(ValueError):
    """A script file that cannot be played; the message names the offending place."""


@dataclass(frozen=True)
class Failure:
    """An HTTP error answered before a turn is served, `times` times per conversation."""

    status: int
    type: str
    message: str
    times: int = 1
    retry_after: float | None = None
    mid_stream: bool = False


@dataclass(frozen=True)
class Turn:
    content: tuple[dict[str, Any], ...]
    stop_reason: str
    usage: Mapping[str, int] = field(default_factory=dict)
    ttft_ms: float | None = None
    failures: tuple[Failure, ...] = ()


@dataclass(frozen=True)
class Script:
    name: str
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class ScriptBook:
    """All scripts one server plays, and which one answers when nothing selects another."""

    scripts: Mapping[str, Script]
    default: str | None = None

    def select(self, body: Mapping[str, Any]) -> Script | None:
        """The script for this request (see the module doc), or None."""
        for text in (_system_text(body), first_user_text(body)):
            match = MARKER.search(text)
            if match and match.group(1) in self.scripts:
                return self.scripts[match.group(1)]
        user_id = str((body.get("metadata") or {}).get("user_id") or "")
        if user_id:
            name = user_id.split(":", 1)[0]
            if name in self.scripts:
                return self.scripts[name]
        return self.scripts.get(self.default) if self.default else None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n".join(
            str(b.get("text", ""))
            for b in content
            if isinstance(b, Mapping) and b.get("type") == "text"
        )
    return ""


def _system_text(body: Mapping[str, Any]) -> str:
    return _text_of(body.get("system") or "")


def first_user_text(body: Mapping[str, Any]) -> str:
    messages = body.get("messages") or []
    return _text_of(messages[0].get("content")) if messages else ""


def conversation_key(body: Mapping[str, Any]) -> str:
    """What identifies a conversation across its requests: `metadata.user_id`, else the first
    user message (so two sessions with the same opening and no user id share a key)."""
    user_id = (body.get("metadata") or {}).get("user_id")
    if user_id:
        return f"user:{user_id}"
    messages = body.get("messages") or []
    first = json.dumps(messages[0].get("content") if messages else "", sort_keys=True)
    return "first:" + hashlib.sha256(first.encode()).hexdigest()[:32]


def turn_index(body: Mapping[str, Any]) -> int:
    """How many assistant turns the conversation already holds (a final prefill excluded)."""
    messages = list(body.get("messages") or [])
    if messages and messages[-1].get("role") == "assistant":
        messages.pop()
    return sum(1 for m in messages if m.get("role") == "assistant")


def stable_id(prefix: str, *parts: object, length: int = 24) -> str:
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).hexdigest()
    return f"{prefix}{digest[:length]}"


def render_content(script: Script, turn_no: int, key: str) -> list[dict[str, Any]]:
    """The turn's content blocks as the API returns them, with deterministic ids."""
    out: list[dict[str, Any]] = []
    for index, block in enumerate(script.turns[turn_no].content):
        kind = block["type"]
        if kind == "text":
            out.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            tool_id = block.get("id") or stable_id("toolu_", key, script.name, turn_no, index)
            out.append(
                {"type": "tool_use", "id": tool_id, "name": block["name"], "input": block["input"]}
            )
        else:
            signature = block.get("signature") or stable_id(
                "sig_", key, script.name, turn_no, index, length=48
            )
            out.append({"type": "thinking", "thinking": block["thinking"], "signature": signature})
    return out


def _parse_failure(raw: Any, where: str) -> Failure:
    if not isinstance(raw, Mapping) or not isinstance(raw.get("error"), Mapping):
        raise ScriptError(
            f'{where}: expected {{"error": {{"status": N, "type": ...}}, "times": N}}'
        )
    error = raw["error"]
    status = int(error.get("status", 529))
    kind = str(error.get("type", "overloaded_error" if status == 529 else "api_error"))
    message = str(error.get("message", f"scripted {kind} (HTTP {status})"))
    times = int(raw.get("times", 1))
    if not 400 <= status <= 599 or times < 0:
        raise ScriptError(f"{where}: status must be 400-599 and times >= 0")
    retry_after = raw.get("retry_after")
    return Failure(
        status,
        kind,
        message,
        times,
        float(retry_after) if retry_after is not None else None,
        bool(raw.get("mid_stream", False)),
    )


def _parse_block(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping) or raw.get("type") not in BLOCK_TYPES:
        raise ScriptError(
            f"{where}: a block must be an object with type one of {', '.join(BLOCK_TYPES)}"
        )
    kind = raw["type"]
    if kind == "text" and not (isinstance(raw.get("text"), str) and raw["text"]):
        raise ScriptError(f"{where}: a text block needs a non-empty string `text`")
    if kind == "thinking" and not isinstance(raw.get("thinking"), str):
        raise ScriptError(f"{where}: a thinking block needs a string `thinking`")
    if kind == "tool_use" and not (
        isinstance(raw.get("name"), str) and isinstance(raw.get("input"), Mapping)
    ):
        raise ScriptError(f"{where}: a tool_use block needs a string `name` and an object `input`")
    return dict(raw)


def _parse_turn(raw: Any, where: str) -> Turn:
    if not isinstance(raw, Mapping):
        raise ScriptError(f"{where}: a turn must be an object")
    if "text" in raw and "content" not in raw:
        raw = {**raw, "content": [{"type": "text", "text": raw["text"]}]}
    blocks = raw.get("content")
    if not isinstance(blocks, list) or not blocks:
        raise ScriptError(f"{where}: a turn needs a non-empty `content` list (or `text`)")
    content = tuple(_parse_block(b, f"{where}.content[{i}]") for i, b in enumerate(blocks))
    has_tool = any(b["type"] == "tool_use" for b in content)
    stop_reason = raw.get("stop_reason", "tool_use" if has_tool else "end_turn")
    if stop_reason not in STOP_REASONS:
        raise ScriptError(f"{where}: stop_reason must be one of {', '.join(STOP_REASONS)}")
    fails = raw.get("fail") or []
    if isinstance(fails, Mapping):
        fails = [fails]
    failures = tuple(_parse_failure(f, f"{where}.fail[{i}]") for i, f in enumerate(fails))
    usage = raw.get("usage") or {}
    if not isinstance(usage, Mapping) or not all(isinstance(v, int) for v in usage.values()):
        raise ScriptError(f"{where}: usage must map token fields to integers")
    ttft = raw.get("ttft_ms")
    return Turn(
        content, stop_reason, dict(usage), float(ttft) if ttft is not None else None, failures
    )


def _parse_script(name: str, raw: Any) -> Script:
    turns = raw.get("turns") if isinstance(raw, Mapping) else raw
    if not isinstance(turns, list) or not turns:
        raise ScriptError(f"script {name!r}: needs a non-empty list of turns")
    return Script(
        name, tuple(_parse_turn(t, f"script {name!r} turn {i}") for i, t in enumerate(turns))
    )


def parse_scripts(raw: Any, *, name: str = "default") -> ScriptBook:
    """Build a `ScriptBook` from decoded JSON/YAML (see the module doc for the shapes)."""
    if isinstance(raw, Mapping) and "scripts" in raw:
        if not isinstance(raw["scripts"], Mapping) or not raw["scripts"]:
            raise ScriptError("`scripts` must be a non-empty object mapping names to scripts")
        scripts = {str(k): _parse_script(str(k), v) for k, v in raw["scripts"].items()}
        default = raw.get("default")
    else:
        if isinstance(raw, Mapping) and "name" in raw:
            name = str(raw["name"])
        scripts = {name: _parse_script(name, raw)}
        default = name
    if default is None:
        default = (
            "default"
            if "default" in scripts
            else (next(iter(scripts)) if len(scripts) == 1 else None)
        )
    if default is not None and default not in scripts:
        raise ScriptError(f"default script {default!r} is not among {sorted(scripts)}")
    return ScriptBook(scripts, default)


def merge(books: Sequence[ScriptBook]) -> ScriptBook:
    """One book holding every script; the first book's default wins."""
    scripts: dict[str, Script] = {}
    for book in books:
        for name, script in book.scripts.items():
            if name in scripts:
                raise ScriptError(f"script {name!r} is defined twice")
            scripts[name] = script
    default = next((b.default for b in books if b.default), None)
    return ScriptBook(scripts, default)


def load_script_file(path: str | Path) -> ScriptBook:
    """Read a script file (JSON, or YAML for .yaml/.yml)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError as exc:
            raise ScriptError(f"{path}: YAML scripts need PyYAML; use JSON instead") from exc
        raw = yaml.safe_load(text)
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ScriptError(f"{path}: not valid JSON: {exc}") from exc
    try:
        return parse_scripts(raw, name=path.stem)
    except ScriptError as exc:
        raise ScriptError(f"{path}: {exc}") from None


def as_book(scripts: Any) -> ScriptBook:
    """Accept a ScriptBook, a Script, a path, decoded JSON, or a list of any of these."""
    if isinstance(scripts, ScriptBook):
        return scripts
    if isinstance(scripts, Script):
        return ScriptBook({scripts.name: scripts}, scripts.name)
    if isinstance(scripts, str | Path):
        return load_script_file(scripts)
    if (
        isinstance(scripts, list)
        and scripts
        and all(isinstance(s, ScriptBook | Script | str | Path) for s in scripts)
    ):
        return merge([as_book(s) for s in scripts])
    return parse_scripts(scripts)
