"""Which scripted turn answers a request, when the client may have trimmed its history.

Counting assistant messages (`script.turn_index`) is stateless and survives any number of
replays, but a client that leaves old events out of its request (a harness whose
conversation outgrew the model's context) holds fewer assistant messages than it was
served, and counting would replay an earlier turn. So the server remembers, per
conversation and script, which turn produced each assistant message it served: by the
message's tool-use ids (deterministic, unique per turn) and by its text (its text blocks
joined, as a client stores them). A request then gets the turn after the one that produced
its most recent assistant message. With no record of that message (a fresh server, a
hand-written history) it falls back to counting, so every stateless use keeps working.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Marks = list[tuple[str, str]]


def _blocks(content: Any) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, Sequence):
        return [b for b in content if isinstance(b, Mapping)]
    return []


def marks(content: Any) -> Marks:
    """What identifies an assistant message: its tool-use ids, else its joined text."""
    blocks = _blocks(content)
    ids = [("tool_use", str(b.get("id"))) for b in blocks if b.get("type") == "tool_use"]
    if ids:
        return ids
    text = "".join(str(b.get("text", "")) for b in blocks if b.get("type") == "text")
    return [("text", text)] if text else []


def last_assistant(messages: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The most recent assistant message that is not a trailing prefill."""
    history = list(messages)
    if history and history[-1].get("role") == "assistant":
        history.pop()
    return next((m for m in reversed(history) if m.get("role") == "assistant"), None)


class ServedTurns:
    """Per conversation and script: the turns that produced each served assistant message.

    Thread-safe; lives as long as the server (a few strings per served turn).
    """

    def __init__(self) -> None:
        self._turns: dict[tuple[str, str, str, str], set[int]] = {}
        self._lock = threading.Lock()

    def record(
        self, key: str, script: str, turn_no: int, content: Iterable[Mapping[str, Any]]
    ) -> None:
        with self._lock:
            for kind, value in marks(list(content)):
                self._turns.setdefault((key, script, kind, value), set()).add(turn_no)

    def following(self, key: str, script: str, messages: Sequence[Mapping[str, Any]]) -> int | None:
        """The turn after the one that produced the request's last assistant message, or
        None when this server has no record of it (the caller counts instead)."""
        last = last_assistant(messages)
        if last is None:
            return None
        found: set[int] = set()
        with self._lock:
            for kind, value in marks(last.get("content")):
                found |= self._turns.get((key, script, kind, value), set())
        if not found:
            return None
        # The same text may have been served by several turns. Trimming only removes
        # assistant messages, so the producing turn is at least the counted one: take the
        # earliest candidate from there (the counted one itself for an untrimmed request).
        counted = sum(1 for m in messages if m.get("role") == "assistant") - 1
        if messages and messages[-1].get("role") == "assistant":
            counted -= 1
        later = [t for t in found if t >= counted]
        return (min(later) if later else max(found)) + 1
