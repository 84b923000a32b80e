"""Named fault-injection points: crash the harness at a chosen step of the loop.

`OMA_HARNESS_FAULT=<point>` makes the harness process SIGKILL itself the first time it
reaches that point (`<point>:<n>` the n-th time). Nothing happens when the variable is unset,
so the checks cost one dictionary lookup. Tests use this to prove that a session survives
its harness dying anywhere: a second harness resumes it from the log.
"""

from __future__ import annotations

import os
import signal

ENV = "OMA_HARNESS_FAULT"

# In loop order.
POINTS: tuple[str, ...] = (
    "after_lease",  # the lease is taken, nothing written yet
    "after_running",  # session.status_running appended
    "after_model_request_start",  # span.model_request_start appended, model not yet called
    "mid_model_stream",  # the model has streamed its first text delta
    "after_tool_use",  # agent.message / agent.tool_use / span end appended
    "before_execute",  # a sandbox is ready, Execute not yet sent
    "during_execute",  # Execute sent and still running in the sandbox
    "after_tool_result",  # agent.tool_result appended
    "before_idle",  # the model's last reply is stored, session.status_idle not yet
    "after_idle",  # session.status_idle appended, the lease not yet released
)

_counts: dict[str, int] = {}


def _armed() -> tuple[str, int] | None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return None
    name, _, nth = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown fault point; known: {', '.join(POINTS)}")
    return name, int(nth or 1)


def validate() -> None:
    """Raise `ValueError` now if the environment names an unknown point (call at startup)."""
    _armed()


def armed(point: str) -> bool:
    """Whether reaching `point` now should crash the process (counts the visit)."""
    target = _armed()
    if target is None or target[0] != point:
        return False
    _counts[point] = _counts.get(point, 0) + 1
    return _counts[point] == target[1]


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def reach(point: str) -> None:
    """Crash here if the environment selects this point."""
    if armed(point):
        crash()
