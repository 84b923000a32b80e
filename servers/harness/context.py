"""What goes into each model request: a replaceable context policy over the session log.

The session log is never compacted or trimmed; it is the record. The model's context window
is a different thing, and what fits in it is a model assumption, so the loop does not decide
it: it asks a `ContextPolicy` (the `context` field of `LoopConfig`) for the messages of each
request. A policy reads the log only through positional slices (`EventSlices.read`: after a
seq, before a seq, a limit, oldest or newest first), the shape of `SessionService.GetEvents`,
so it never needs the whole log in memory. `LogSlices` serves slices from events the caller
already holds (the loop keeps the events it has read and appended); `SessionSlices` reads
them from the session service.

The default, `SlidingWindowPolicy` (contract: HARNESS-CONTEXT-001):

* While the request fits its token budget (an estimate: `chars_per_token` characters per
  token of system prompt, tool definitions and messages), the request holds the whole
  conversation, exactly as `conversation.build_messages` renders the log.
* Beyond the budget the request is built from three slices: **the task** (the user
  messages at the start of the log, before the model's first reply), then a short **marker**
  text saying which events were left out (the log keeps them), then **what led up to the
  current action** (the user messages of the turn the window starts in: the request being
  worked on, when it is older than the window) and **the most recent events** (the window),
  which runs from the start of a model request to the end of the log. Cutting only where a model request starts keeps every
  `tool_use`/`tool_result` pair whole (a harness settles every call before it asks the
  model again), and same-role blocks merge, so roles alternate as the API requires.
* The prompt cache keeps hitting: a `cache_control` breakpoint on the task's last block
  makes system + tools + task a stable prefix that every request shares, and the window's
  start moves in coarse steps: it is the first model request at or after the smallest
  multiple of `step_events` (a seq) from which the rest fits. The start only moves when that
  grid point is passed, so for several requests in a row the prefix up to the window's end
  is unchanged and the request extends the previous one (the loop's automatic caching then
  reads all of it from the cache). It is a pure function of the log: a successor harness
  builds the same request.

`step_events` trades cache hits for context: after a move the window holds up to
`step_events` fewer events than would fit. Keep it well below the number of events the
window holds; when the grid point lies past the last model request, the window starts at the
first model request that fits (it then moves every request until the next grid point).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from oma.servers.harness import conversation
from oma.servers.harness import events as ev
from oma.servers.harness.events import LogEvent

Message = dict[str, Any]

EPHEMERAL = {"type": "ephemeral"}


# By name rather than by list, so that every kind of tool call (sandbox, custom, MCP, and
# kinds added later) is cut and paired alike: `agent.<kind>tool_use` and `<...>tool_result`.
def _is_use(event: LogEvent) -> bool:
    return event.type.startswith("agent.") and event.type.endswith("tool_use")


def _is_result(event: LogEvent) -> bool:
    return event.type.endswith("tool_result")


def _is_reply(event: LogEvent) -> bool:
    return event.type == ev.AGENT_MESSAGE or _is_use(event)


def _in_conversation(event: LogEvent) -> bool:
    return event.type == ev.USER_MESSAGE or _is_reply(event) or _is_result(event)


class EventSlices(Protocol):
    """Positional reads of one session's log (the shape of `GetEvents`)."""

    async def read(
        self,
        *,
        after_seq: int = 0,
        before_seq: int = 0,
        limit: int = 100,
        newest_first: bool = False,
        types: Sequence[str] = (),
    ) -> list[LogEvent]:
        """At most `limit` events with `after_seq < seq < before_seq` (0: no upper bound),
        of the given types (empty: all), oldest or newest first."""
        ...


class LogSlices:
    """Slices of events already in memory (sorted by seq, e.g. the loop's local log)."""

    def __init__(self, events: Sequence[LogEvent]) -> None:
        self._events = events

    async def read(
        self,
        *,
        after_seq: int = 0,
        before_seq: int = 0,
        limit: int = 100,
        newest_first: bool = False,
        types: Sequence[str] = (),
    ) -> list[LogEvent]:
        low = bisect.bisect_right(self._events, after_seq, key=lambda e: e.seq)
        high = (
            bisect.bisect_left(self._events, before_seq, key=lambda e: e.seq)
            if before_seq
            else len(self._events)
        )
        indexes = range(high - 1, low - 1, -1) if newest_first else range(low, high)
        out: list[LogEvent] = []
        for i in indexes:
            if len(out) >= limit:
                break
            if not types or self._events[i].type in types:
                out.append(self._events[i])
        return out


class SliceReader(Protocol):
    """What `SessionSlices` needs of a session port (`GrpcSession.read_slice`)."""

    async def read_slice(
        self,
        session_id: str,
        *,
        after_seq: int,
        before_seq: int,
        limit: int,
        newest_first: bool,
        types: Sequence[str],
    ) -> list[LogEvent]: ...


class SessionSlices:
    """Slices read from the session service, one `GetEvents` page each."""

    def __init__(self, port: SliceReader, session_id: str) -> None:
        self._port = port
        self._session_id = session_id

    async def read(
        self,
        *,
        after_seq: int = 0,
        before_seq: int = 0,
        limit: int = 100,
        newest_first: bool = False,
        types: Sequence[str] = (),
    ) -> list[LogEvent]:
        return await self._port.read_slice(
            self._session_id,
            after_seq=after_seq,
            before_seq=before_seq,
            limit=limit,
            newest_first=newest_first,
            types=types,
        )


@dataclass(frozen=True)
class Context:
    """The messages of one model request, and how much of the log they leave out."""

    messages: list[Message]
    estimated_tokens: int
    # First and last seq of the events left out; None when the whole conversation is there.
    omitted: tuple[int, int] | None = None


class ContextPolicy(Protocol):
    """Decides what each model request holds (see the module doc for the default)."""

    async def build(
        self,
        events: EventSlices,
        *,
        system: str,
        tools: Sequence[Mapping[str, Any]],
        caching: bool,
    ) -> Context:
        """The request's `messages`; with `caching`, `cache_control` breakpoints may be
        placed in them (the request itself also asks for automatic caching, so at most
        three)."""
        ...


def estimate_tokens(value: Any, chars_per_token: float) -> int:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return max(1, math.ceil(len(text) / chars_per_token))


def _event_tokens(event: LogEvent, chars_per_token: float) -> int:
    if not _in_conversation(event):
        return 0
    size = len(event.text) + len(event.tool_use_id) + len(event.tool_name)
    if event.tool_input:
        size += len(json.dumps(event.tool_input, separators=(",", ":")))
    # Block framing ("type", ids, role) costs a few tokens per block.
    return math.ceil(size / chars_per_token) + 8


def _mark_task(messages: list[Message], task_blocks: int) -> None:
    if task_blocks and messages:
        block = messages[0]["content"][task_blocks - 1]
        messages[0]["content"][task_blocks - 1] = {**block, "cache_control": EPHEMERAL}


async def _read_all(events: EventSlices, page: int) -> list[LogEvent]:
    out: list[LogEvent] = []
    while True:
        batch = await events.read(after_seq=out[-1].seq if out else 0, limit=page)
        out.extend(batch)
        if len(batch) < page:
            return out


@dataclass(frozen=True)
class WholeLogPolicy:
    """Every event of the log in every request (a model whose context holds any session)."""

    page: int = 500

    async def build(
        self,
        events: EventSlices,
        *,
        system: str,
        tools: Sequence[Mapping[str, Any]],
        caching: bool,
    ) -> Context:
        log = await _read_all(events, self.page)
        messages = conversation.build_messages(log)
        tokens = sum(_event_tokens(e, 4.0) for e in log)
        return Context(messages, tokens)


@dataclass(frozen=True)
class SlidingWindowPolicy:
    """The task, a marker, and a window of recent events that moves in coarse steps."""

    # Estimated prompt tokens (system, tools, messages) a request may hold. Leave room for
    # the reply (`max_tokens`) and for the estimate's error below the model's context size.
    budget_tokens: int = 150_000
    # Granularity, in seqs, of where the window may start (see the module doc).
    step_events: int = 32
    chars_per_token: float = 4.0
    # Events per slice read.
    page: int = 200

    def __post_init__(self) -> None:
        if self.budget_tokens < 1 or self.step_events < 1 or self.page < 1:
            raise ValueError("budget_tokens, step_events and page must be at least 1")
        if self.chars_per_token <= 0:
            raise ValueError("chars_per_token must be positive")

    def _tokens(self, event: LogEvent) -> int:
        return _event_tokens(event, self.chars_per_token)

    async def _task(self, events: EventSlices) -> tuple[list[LogEvent], int]:
        """The user messages before the model's first reply, and the seq the task ends at
        (the last event read before that reply)."""
        task: list[LogEvent] = []
        after = 0
        while True:
            batch = await events.read(after_seq=after, limit=self.page)
            for event in batch:
                if _is_reply(event):
                    return task, after
                if event.type == ev.USER_MESSAGE and event.text:
                    task.append(event)
                after = event.seq
            if len(batch) < self.page:
                return task, after

    async def build(
        self,
        events: EventSlices,
        *,
        system: str,
        tools: Sequence[Mapping[str, Any]],
        caching: bool,
    ) -> Context:
        cpt = self.chars_per_token
        task, task_end = await self._task(events)
        fixed = (
            (estimate_tokens(system, cpt) if system else 0)
            + sum(estimate_tokens(dict(t), cpt) for t in tools)
            + sum(self._tokens(e) for e in task)
        )
        room = self.budget_tokens - fixed
        # The tail, newest first, until it reaches the task or outgrows the room left.
        tail: list[LogEvent] = []
        used = 0
        overflow: LogEvent | None = None
        before = 0
        while overflow is None:
            batch = await events.read(
                after_seq=task_end, before_seq=before, limit=self.page, newest_first=True
            )
            for event in batch:
                cost = self._tokens(event)
                if used + cost > room:
                    overflow = event
                    break
                used += cost
                tail.append(event)
            if len(batch) < self.page:
                break
            before = batch[-1].seq
        if overflow is None:
            messages = conversation.build_messages([*task, *reversed(tail)])
            if caching:
                _mark_task(messages, len(task))
            return Context(messages, fixed + used)
        return await self._trimmed(events, task, task_end, tail, overflow, fixed, caching)

    async def _trimmed(
        self,
        events: EventSlices,
        task: list[LogEvent],
        task_end: int,
        tail: list[LogEvent],
        overflow: LogEvent,
        fixed: int,
        caching: bool,
    ) -> Context:
        fits_from = overflow.seq + 1
        grid = math.ceil(fits_from / self.step_events) * self.step_events
        starts = sorted(e.seq for e in tail if e.type == ev.SPAN_START)
        start = next((s for s in starts if s >= grid), None)
        if start is None:
            start = starts[0] if starts else None
        if start is None:
            # Even the latest model request's events overflow: start at it regardless, so
            # that the request ends with what the model must answer.
            latest = await events.read(
                after_seq=task_end,
                before_seq=overflow.seq + 1,
                limit=1,
                newest_first=True,
                types=(ev.SPAN_START,),
            )
            start = latest[0].seq if latest else overflow.seq
        window = sorted((e for e in tail if e.seq >= start), key=lambda e: e.seq)
        if start < fits_from:
            window = [
                *await self._between(events, start - 1, fits_from),
                *window,
            ]
        uses = {e.tool_use_id for e in window if _is_use(e)}
        window = [e for e in window if not _is_result(e) or e.tool_use_id in uses]
        leading = await self._current_request(events, task_end, start)
        marker = LogEvent(
            seq=start - 1,
            id="context.marker",
            type=ev.USER_MESSAGE,
            text=(
                f"[Context note: events {task_end + 1} to {start - 1} of this session's log "
                "are left out of this request to fit the model's context; the log keeps "
                "them. What follows is the user's current request (when it is older than "
                "the window) and the most recent events.]"
            ),
        )
        messages = conversation.build_messages([*task, marker, *leading, *window])
        if caching:
            _mark_task(messages, len(task))
        tokens = fixed + sum(self._tokens(e) for e in (marker, *leading, *window))
        return Context(messages, tokens, (task_end + 1, start - 1))

    async def _between(self, events: EventSlices, after: int, before: int) -> list[LogEvent]:
        out: list[LogEvent] = []
        while True:
            batch = await events.read(
                after_seq=out[-1].seq if out else after, before_seq=before, limit=self.page
            )
            out.extend(batch)
            if len(batch) < self.page:
                return out

    async def _current_request(
        self, events: EventSlices, task_end: int, start: int
    ) -> list[LogEvent]:
        """The user messages before the window, back to the idle before them: the request
        that the window's first events work on."""
        found: list[LogEvent] = []
        before = start
        while True:
            batch = await events.read(
                after_seq=task_end,
                before_seq=before,
                limit=self.page,
                newest_first=True,
                types=(ev.USER_MESSAGE, ev.STATUS_IDLE),
            )
            for event in batch:
                if event.type == ev.STATUS_IDLE:
                    return list(reversed(found))
                if event.text:
                    found.append(event)
            if len(batch) < self.page:
                return list(reversed(found))
            before = batch[-1].seq
