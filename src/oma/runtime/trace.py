"""W3C trace context (`traceparent`, `tracestate`) carried in gRPC metadata.

Promises ([COMMON-TRACE-001]):
- While a server handles a call, `current()` is the trace context the caller sent (or, when
  it sent none or a malformed one, a freshly started trace), so every call is in a trace.
- Every call made through a channel from `oma.runtime.client.connect` sends a `traceparent`
  with the trace id of `current()` and a new span id for the outgoing call, plus the
  unchanged `tracestate`. Outside any call and with no `use(...)` in force, a new trace is
  started per outgoing call.
- `use(ctx)` makes `ctx` current for a block (a CLI that wants one trace for its calls).
"""

from __future__ import annotations

import contextvars
import re
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# version 00 layout; future versions may append fields after a dash, which we ignore.
_TRACEPARENT_RE = re.compile(
    r"^(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})-(?P<parent_id>[0-9a-f]{16})-"
    r"(?P<flags>[0-9a-f]{2})(?P<rest>-.*)?$"
)
_INVALID_TRACE_ID = "0" * 32
_INVALID_PARENT_ID = "0" * 16


@dataclass(frozen=True)
class TraceContext:
    """One position in a distributed trace: the trace, the span that made the call, flags."""

    trace_id: str
    parent_id: str
    flags: str = "01"
    tracestate: str = ""

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags}"

    @classmethod
    def new(cls) -> TraceContext:
        """Start a new, sampled trace."""
        return cls(secrets.token_hex(16), secrets.token_hex(8), "01")

    def child(self) -> TraceContext:
        """Same trace and state, a new span id: what an outgoing call carries."""
        return TraceContext(self.trace_id, secrets.token_hex(8), self.flags, self.tracestate)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        pairs: list[tuple[str, str]] = [(TRACEPARENT, self.traceparent)]
        if self.tracestate:
            pairs.append((TRACESTATE, self.tracestate))
        return tuple(pairs)


def parse(traceparent: str | None, tracestate: str | None = None) -> TraceContext | None:
    """Parse a `traceparent` header value; None when absent or malformed (per W3C, an
    invalid traceparent is ignored and its tracestate with it)."""
    if not traceparent:
        return None
    match = _TRACEPARENT_RE.match(traceparent.strip().lower())
    if match is None:
        return None
    version = match["version"]
    if version == "ff" or (version == "00" and match["rest"]):
        return None
    if match["trace_id"] == _INVALID_TRACE_ID or match["parent_id"] == _INVALID_PARENT_ID:
        return None
    return TraceContext(match["trace_id"], match["parent_id"], match["flags"], tracestate or "")


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> TraceContext | None:
    """The trace context in gRPC invocation metadata, or None."""
    parent: str | None = None
    state: list[str] = []
    for key, value in metadata or ():
        if isinstance(value, bytes):
            continue
        if key == TRACEPARENT and parent is None:
            parent = value
        elif key == TRACESTATE:
            state.append(value)
    return parse(parent, ",".join(state))


_current: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar(
    "oma_trace_context", default=None
)


def current() -> TraceContext | None:
    """The trace context of the call being handled (or set by `use`), else None."""
    return _current.get()


def set_current(ctx: TraceContext | None) -> contextvars.Token[TraceContext | None]:
    return _current.set(ctx)


def reset(token: contextvars.Token[TraceContext | None]) -> None:
    _current.reset(token)


@contextmanager
def use(ctx: TraceContext) -> Iterator[TraceContext]:
    """Make `ctx` the current trace context within the block."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def outgoing() -> TraceContext:
    """The context an outgoing call should carry: a child of `current()`, or a new trace."""
    ctx = _current.get()
    return ctx.child() if ctx is not None else TraceContext.new()
