"""The harness's core: turns `Wake` calls into at most one running turn per session.

It knows nothing of gRPC. A wake takes the session's lease, reads the log, and either
releases the lease (nothing to do) or starts a background task that runs the turn, renews the
lease while it runs and releases it at the end. The task is not tied to the waking call, so
the turn runs to its end whatever the caller's deadline.

No wake is lost between a turn's idle and its lease release. A turn's task releases the lease
first and then reads the log once more: input appended before that read is driven by the same
task (a new turn under a new lease), and a wake of this harness that arrives after the read
finds the task gone and takes the lease itself. A wake that lands while the task is still
running marks it (`rewake`), so the task looks again even if its read raced the caller's
append. A wake of another harness in that window gets `ALREADY_DRIVEN`; the re-read covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import uuid
from dataclasses import dataclass, field

import anthropic

from oma.servers.harness import conversation, faults
from oma.servers.harness import events as ev
from oma.servers.harness.loop import LoopConfig, Turn
from oma.servers.harness.ports import (
    Lease,
    LeaseHeld,
    LeaseLost,
    McpPort,
    SandboxPort,
    SessionPort,
    Unreachable,
)

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    STARTED = "started"
    ALREADY_DRIVEN = "already_driven"
    NOTHING_TO_DO = "nothing_to_do"


@dataclass(frozen=True)
class WakeResult:
    outcome: Outcome
    holder_id: str = ""
    last_seq: int = 0


@dataclass
class _Driving:
    """A session this harness drives: its task, and what a concurrent wake needs to know."""

    turn: Turn
    task: asyncio.Task[str | None] | None = None
    # The turn has gone idle; the task is releasing the lease and re-reading the log.
    finishing: bool = False
    # A wake arrived while the task ran: the task must look at the log again before ending.
    rewake: bool = False


@dataclass(frozen=True)
class DriverConfig:
    lease_ttl_seconds: float = 30.0
    loop: LoopConfig = field(default_factory=LoopConfig)


class Driver:
    """Drives sessions on behalf of one harness process."""

    def __init__(
        self,
        session: SessionPort,
        sandbox: SandboxPort,
        model: anthropic.AsyncAnthropic,
        config: DriverConfig | None = None,
        holder_id: str | None = None,
        mcp: McpPort | None = None,
    ) -> None:
        self._session = session
        self._sandbox = sandbox
        self._model = model
        self._mcp = mcp
        self.config = config or DriverConfig()
        self.holder_id = holder_id or f"harness-{uuid.uuid4().hex[:12]}"
        # Only sessions driven right now: an entry goes when its task ends, so a long-lived
        # harness holds nothing per session it drove in the past.
        self._driving: dict[str, _Driving] = {}
        self._lock = asyncio.Lock()
        self._closing = False

    def task(self, session_id: str) -> asyncio.Task[str | None] | None:
        """The task driving the session here now (it may run several turns back to back, when
        input arrives as one ends), or None when this harness does not drive it."""
        driving = self._driving.get(session_id)
        return driving.task if driving is not None else None

    @property
    def sessions(self) -> list[str]:
        """Ids of the sessions this harness drives right now."""
        return list(self._driving)

    async def settled(self, session_id: str) -> str | None:
        """Wait until this harness no longer drives the session (its lease released); returns
        the last stop reason of the task that was driving it, None when none was."""
        task = self.task(session_id)
        if task is None:
            return None
        with contextlib.suppress(asyncio.CancelledError):
            return await asyncio.shield(task)
        return None

    async def wake(self, session_id: str) -> WakeResult:
        # One lock per process keeps two local wakes from both taking the same holder's lease
        # (a session service may treat a re-acquire by the same holder as a renewal).
        async with self._lock:
            driving = self._driving.get(session_id)
            if driving is not None and driving.task is not None and not driving.task.done():
                driving.rewake = True
                # The turn may be idle already (a caller can see the idle before this task
                # does): then answer from the log, as a wake after the lease's release would
                # (HARNESS-WAKE-003). Only the events after the turn's last seq are read.
                tail = await self._session.read_events(session_id, driving.turn.last_seq)
                idle = driving.finishing or any(e.type == ev.STATUS_IDLE for e in tail)
                if idle and not conversation.has_work(tail):
                    return WakeResult(Outcome.NOTHING_TO_DO)
                return WakeResult(Outcome.ALREADY_DRIVEN, self.holder_id)
            if self._closing:
                raise Unreachable("the harness is shutting down")
            try:
                lease = await self._session.acquire_lease(
                    session_id, self.holder_id, self.config.lease_ttl_seconds
                )
            except LeaseHeld as held:
                return WakeResult(Outcome.ALREADY_DRIVEN, held.holder_id)
            faults.reach("after_lease")
            turn = await self._turn(lease)
            if turn is None:
                return WakeResult(Outcome.NOTHING_TO_DO)
            driving = _Driving(turn)
            driving.task = asyncio.create_task(self._drive(driving), name=f"turn:{session_id}")
            self._driving[session_id] = driving
            driving.task.add_done_callback(lambda _: self._forget(session_id, driving))
            return WakeResult(Outcome.STARTED, self.holder_id, turn.last_seq)

    def _forget(self, session_id: str, driving: _Driving) -> None:
        if self._driving.get(session_id) is driving:
            del self._driving[session_id]

    async def _turn(self, lease: Lease) -> Turn | None:
        """The turn to run under `lease`, or None (lease released) when there is nothing to do."""
        try:
            definition = await self._session.definition(lease.session_id)
            events = await self._session.read_events(lease.session_id, 0)
        except BaseException:
            await self._release(lease)
            raise
        if not conversation.has_work(events):
            await self._release(lease)
            return None
        return Turn(
            self._session,
            self._sandbox,
            self._model,
            self.config.loop,
            lease,
            definition,
            events,
            mcp=self._mcp,
        )

    async def _drive(self, driving: _Driving) -> str | None:
        """Run turns until the session needs nothing more from this harness."""
        while True:
            turn = driving.turn
            stop = await self._run(turn)
            if stop is None or self._closing:
                return stop
            # The lease is released (in `_run`); look once more for input that arrived while
            # the turn was ending. Nothing may be awaited between the check and the return:
            # a wake that sees this task still running relies on the check coming after it.
            driving.rewake = False
            try:
                tail = await self._session.read_events(turn.session_id, turn.last_seq)
            except Exception as error:  # the session service's own pushes cover it
                log.warning("session %s: could not re-read the log: %s", turn.session_id, error)
                return stop
            if not conversation.has_work(tail) and not driving.rewake:
                return stop
            try:
                lease = await self._session.acquire_lease(
                    turn.session_id, self.holder_id, self.config.lease_ttl_seconds
                )
            except LeaseHeld:
                return stop  # another harness took it: it drives the new input
            except Exception as error:
                log.warning("session %s: could not resume: %s", turn.session_id, error)
                return stop
            try:
                next_turn = await self._turn(lease)
            except Exception as error:
                log.warning("session %s: could not resume: %s", turn.session_id, error)
                return stop
            if next_turn is None:
                return stop
            driving.turn, driving.finishing = next_turn, False

    async def _run(self, turn: Turn) -> str | None:
        """One turn under its lease; releases the lease. Returns the stop reason of the idle
        it wrote (an aborted turn's too), None when it wrote none (fenced out)."""
        lease = turn.lease
        renewer = asyncio.create_task(self._renew(lease, asyncio.current_task()))
        try:
            stop = await turn.run()
            log.info("session %s idle: %s", lease.session_id, stop)
            driving = self._driving.get(lease.session_id)
            if driving is not None and driving.turn is turn:
                driving.finishing = True
            return stop
        except LeaseLost:
            log.warning("session %s: lease lost; another harness drives it", lease.session_id)
            return None
        except asyncio.CancelledError:
            if self._closing:
                log.info("session %s: rescheduled (harness shutting down)", lease.session_id)
                try:
                    await turn.reschedule("the harness driving the session shut down")
                except Exception as error:  # the lease expires and the log is intact anyway
                    log.warning(
                        "session %s: could not record the reschedule: %s", lease.session_id, error
                    )
            raise
        except Exception as error:
            log.exception("session %s: turn failed", lease.session_id)
            try:
                stop = await turn.abort(error)
            except Exception:  # the session service itself is failing; the log stays intact
                log.exception("session %s: could not record the failure", lease.session_id)
                return None
            driving = self._driving.get(lease.session_id)
            if driving is not None and driving.turn is turn:
                driving.finishing = True
            return stop
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            await self._release(lease)

    async def _renew(self, lease: Lease, owner: asyncio.Task[object] | None) -> None:
        interval = max(0.2, lease.ttl_seconds / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                lease = await self._session.renew_lease(lease)
            except LeaseLost:
                if owner is not None:
                    owner.cancel()
                return
            except Exception as error:  # transient: the next renewal may succeed in time
                log.warning("session %s: lease renewal failed: %s", lease.session_id, error)

    async def _release(self, lease: Lease) -> None:
        try:
            await self._session.release_lease(lease)
        except Exception as error:  # the lease expires on its own
            log.warning("session %s: lease release failed: %s", lease.session_id, error)

    async def close(self) -> None:
        """Stop running turns: each appends `session.status_rescheduled` and releases its
        lease, so another harness can resume it at once."""
        self._closing = True
        tasks = [d.task for d in self._driving.values() if d.task is not None and not d.task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
