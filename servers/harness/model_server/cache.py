"""Token estimates and a prompt-cache simulation.

Tokens are estimated, deterministically, as `ceil(len(text) / 4)` (at least 1) per unit of
the prompt, where a unit is one tool definition, one system block or one message content
block, serialised as canonical JSON (sorted keys, compact). Estimates are stable across runs
and grow with the prompt, which is all tests and benchmarks need.

The prompt is the sequence tools → system → messages, the order in which the real API caches.
The cacheable prefix ends at the last unit that carries `cache_control` (or at the end of the
prompt when the request has a top-level `cache_control`, the API's automatic caching). For each request the
simulation reports

* `cache_read_input_tokens`: the longest prefix of the cacheable prefix that an earlier request
  of the same conversation (key: model + `metadata.user_id`, else the first user message) also
  had in its cacheable prefix;
* `cache_creation_input_tokens`: the rest of the cacheable prefix (now written to the cache);
* `input_tokens`: everything after the last breakpoint.

Unlike the real API there is no minimum cacheable length and no expiry, so small tests show
cache behaviour; a request without `cache_control` reads and writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class Unit:
    text: str
    tokens: int
    breakpoint: bool


def prompt_units(body: Mapping[str, Any]) -> list[Unit]:
    """The request's prompt as cache units, in cache order."""
    units: list[Unit] = []

    def add(value: Any, role: str = "") -> None:
        marked = isinstance(value, Mapping) and bool(value.get("cache_control"))
        if isinstance(value, Mapping):
            # A breakpoint marks a position; it is not part of the cached content.
            value = {k: v for k, v in value.items() if k != "cache_control"}
        text = role + _canonical(value)
        units.append(Unit(text, estimate_tokens(text), marked))

    for tool in body.get("tools") or []:
        add(tool)
    system = body.get("system")
    if isinstance(system, str) and system:
        add({"type": "text", "text": system})
    elif isinstance(system, list):
        for block in system:
            add(block)
    for message in body.get("messages") or []:
        content = message["content"]
        if isinstance(content, str):
            add({"type": "text", "text": content}, message["role"])
        else:
            for block in content:
                add(block, message["role"])
    return units


@dataclass(frozen=True)
class PromptUsage:
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int

    @property
    def total(self) -> int:
        return self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens


def count_input_tokens(body: Mapping[str, Any]) -> int:
    return sum(unit.tokens for unit in prompt_units(body))


class PromptCache:
    """Per-conversation memory of cached prefixes (thread-safe; lives as long as the server)."""

    def __init__(self) -> None:
        self._prefixes: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def account(self, key: str, body: Mapping[str, Any]) -> PromptUsage:
        """Usage for this request, recording its cacheable prefix for later requests."""
        units = prompt_units(body)
        last_breakpoint = max((i for i, u in enumerate(units) if u.breakpoint), default=-1)
        if body.get("cache_control"):
            # Automatic caching: a top-level `cache_control` marks the end of the prompt.
            last_breakpoint = len(units) - 1
        cacheable = units[: last_breakpoint + 1]
        hashes: list[str] = []
        running = hashlib.sha256()
        for unit in cacheable:
            running.update(unit.text.encode())
            running.update(b"\x1e")
            hashes.append(running.copy().hexdigest())
        with self._lock:
            known = self._prefixes.setdefault(f"{body.get('model')}\x1f{key}", set())
            hit = 0
            for i, digest in enumerate(hashes):
                if digest in known:
                    hit = i + 1
            known.update(hashes)
        read = sum(u.tokens for u in cacheable[:hit])
        created = sum(u.tokens for u in cacheable[hit:])
        rest = sum(u.tokens for u in units[last_breakpoint + 1 :])
        return PromptUsage(rest, created, read)
