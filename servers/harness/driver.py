"""The harness's core: turns `Wake` calls into at most one running turn per session.

It knows nothing of gRPC. A wake takes the session's lease, reads the log, and either
releases the lease (nothing to do) or starts a background task that runs the turn, renews the
lease while it runs and releases it at the end. The task is not tied to the waking call, so
the turn runs to its end whatever the caller's deadline.
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
from oma.servers.harness.loop import LoopConfig, Turn
from oma.servers.harness.ports import (
    Lease,
    LeaseHeld,
    LeaseLost,
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
    ) -> None:
        self._session = session
        self._sandbox = sandbox
        self._model = model
        self.config = config or DriverConfig()
        self.holder_id = holder_id or f"harness-{uuid.uuid4().hex[:12]}"
        self._tasks: dict[str, asyncio.Task[str | None]] = {}
        self._lock = asyncio.Lock()
        self._closing = False

    def task(self, session_id: str) -> asyncio.Task[str | None] | None:
        """The running (or last finished) turn's task of a session driven here."""
        return self._tasks.get(session_id)

    async def wake(self, session_id: str) -> WakeResult:
        # One lock per process keeps two local wakes from both taking the same holder's lease
        # (a session service may treat a re-acquire by the same holder as a renewal).
        async with self._lock:
            running = self._tasks.get(session_id)
            if running is not None and not running.done():
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
            try:
                definition = await self._session.definition(session_id)
                events = await self._session.read_events(session_id, 0)
            except BaseException:
                await self._release(lease)
                raise
            if not conversation.has_work(events):
                await self._release(lease)
                return WakeResult(Outcome.NOTHING_TO_DO)
            turn = Turn(
                self._session,
                self._sandbox,
                self._model,
                self.config.loop,
                lease,
                definition,
                events,
            )
            self._tasks[session_id] = asyncio.create_task(
                self._drive(turn, lease), name=f"turn:{session_id}"
            )
            return WakeResult(Outcome.STARTED, self.holder_id, turn.last_seq)

    async def _drive(self, turn: Turn, lease: Lease) -> str | None:
        renewer = asyncio.create_task(self._renew(lease, asyncio.current_task()))
        try:
            stop = await turn.run()
            log.info("session %s idle: %s", lease.session_id, stop)
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
                await turn.abort(error)
            except Exception:  # the session service itself is failing; the log stays intact
                log.exception("session %s: could not record the failure", lease.session_id)
            return None
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
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
