"""Worker mode: drive the sessions the session service pushes, up to a cap, until stopped.

A worker holds one `WatchPendingSessions` stream open (through a `PendingFeed`). Every id it
pushes — first a snapshot, then each session as it comes to need a harness — is queued and
handed to the same `Driver` that serves `Wake`: the driver takes the lease (losing the race to
another worker is `ALREADY_DRIVEN`, and the id is dropped), runs the turn in the background,
renews the lease and releases it at the end. Nothing here polls: a session is only ever started
because the stream named it, so the delay from a user's append to the turn is one push.

Why ids are acquired one by one rather than with claim mode (`AcquireLease` without a session
id): the session service calls a session pending when any `user.*` event follows its last idle,
while the harness may find nothing to answer (a `user.interrupt` on an idle session). Claim mode
would hand such a session out first again and again; a pushed id can be remembered as "nothing
to do at this seq" and skipped until the log moves.

Stopping (SIGTERM) stops taking sessions at once; `Driver.close()` then gives the running ones
back (`session.status_rescheduled` under the fencing token, lease released), so the session
service pushes them to the other workers straight away. A worker that dies without that loses
its sessions to the others when their leases expire (the session service pushes on expiry).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from oma.servers.harness.driver import Driver, Outcome
from oma.servers.harness.ports import SessionGone, Unreachable

log = logging.getLogger(__name__)

# How many "nothing to do at seq N" verdicts a worker remembers (oldest forgotten first).
_MEMO_SIZE = 10_000


@dataclass(frozen=True)
class Pending:
    """One push: a session that needs a harness, and its last seq when pushed."""

    session_id: str
    last_seq: int


class PendingFeed(Protocol):
    def watch(self) -> AsyncIterator[Pending]:
        """Open the push stream: a snapshot of the sessions pending now, then live pushes.
        Ends or raises when the stream drops; the worker reopens it."""
        ...


@dataclass(frozen=True)
class WorkerConfig:
    # Sessions this worker drives at once; further pushes wait in its queue (or go to others).
    max_sessions: int = 16
    reconnect_initial_seconds: float = 0.1
    reconnect_max_seconds: float = 5.0


class Worker:
    """Feeds pushed session ids into a `Driver`, at most `max_sessions` turns at a time."""

    def __init__(
        self, driver: Driver, feed: PendingFeed, config: WorkerConfig | None = None
    ) -> None:
        self._driver = driver
        self._feed = feed
        self.config = config or WorkerConfig()
        if self.config.max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        # Pushed ids not yet tried, in push order, with the last seq of their latest push.
        self._queue: OrderedDict[str, int] = OrderedDict()
        self._driving: dict[str, asyncio.Task[str | None]] = {}
        self._nothing_at: OrderedDict[str, int] = OrderedDict()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self.streams_opened = 0  # how many times the push stream was (re)opened
        self.turns_started = 0

    @property
    def driving(self) -> int:
        return len(self._driving)

    def start(self) -> None:
        """Start watching and dispatching (call inside the event loop that will run them)."""
        self._tasks = [
            asyncio.create_task(self._watch(), name="worker:watch"),
            asyncio.create_task(self._dispatch(), name="worker:dispatch"),
        ]

    async def stop(self) -> None:
        """Stop taking sessions. Running turns go on: the caller hands them back with
        `Driver.close()` (or lets them finish)."""
        self._stopping = True
        self._wakeup.set()
        watch, dispatch = self._tasks or (None, None)
        if watch is not None:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
        if dispatch is not None:
            # Not cancelled: a wake cut between the lease grant and its reply would leave a
            # lease nobody renews or releases. The dispatcher exits after the wake in hand.
            await dispatch

    # -- the push stream ----------------------------------------------------------------------

    async def _watch(self) -> None:
        delay = self.config.reconnect_initial_seconds
        while not self._stopping:
            self.streams_opened += 1
            log.info("watching pending sessions (stream %d)", self.streams_opened)
            try:
                async for item in self._feed.watch():
                    delay = self.config.reconnect_initial_seconds
                    self._offer(item)
                log.warning("the pending-session stream ended; reopening it")
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning("the pending-session stream failed (%s); reopening it", error)
            # Jittered, so that many workers do not reconnect in lockstep after an outage.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(self.config.reconnect_max_seconds, delay * 2)

    def _offer(self, item: Pending) -> None:
        log.info("session %s pushed (last seq %d)", item.session_id, item.last_seq)
        # A repeat keeps its place in the queue but carries the newer seq.
        self._queue[item.session_id] = item.last_seq
        self._wakeup.set()

    # -- starting turns -----------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while not self._stopping:
            await self._wakeup.wait()
            self._wakeup.clear()
            while (
                not self._stopping and self._queue and len(self._driving) < self.config.max_sessions
            ):
                session_id, last_seq = self._queue.popitem(last=False)
                if session_id in self._driving:
                    continue  # a stale push: our own release re-pushes it if it still needs one
                if self._nothing_at.get(session_id) == last_seq:
                    continue  # already found nothing to answer at this point of its log
                await self._start(session_id, last_seq)

    async def _start(self, session_id: str, last_seq: int) -> None:
        try:
            result = await self._driver.wake(session_id)
        except SessionGone:
            return
        except Unreachable as error:
            if self._stopping:
                return
            log.warning("session %s: cannot start it now (%s); retrying", session_id, error)
            self._queue.setdefault(session_id, last_seq)
            await asyncio.sleep(self.config.reconnect_initial_seconds * random.uniform(1, 5))
            self._wakeup.set()
            return
        except Exception:
            log.exception("session %s: wake failed", session_id)
            return
        if result.outcome is Outcome.NOTHING_TO_DO:
            log.info("session %s: nothing to answer at seq %d", session_id, last_seq)
            self._nothing_at[session_id] = last_seq
            self._nothing_at.move_to_end(session_id)
            while len(self._nothing_at) > _MEMO_SIZE:
                self._nothing_at.popitem(last=False)
            return
        task = self._driver.task(session_id)
        if result.outcome is not Outcome.STARTED or task is None:
            return  # another harness holds it
        log.info("session %s: turn started from a push", session_id)
        self.turns_started += 1
        self._nothing_at.pop(session_id, None)
        self._driving[session_id] = task
        task.add_done_callback(lambda _: self._finished(session_id))

    def _finished(self, session_id: str) -> None:
        self._driving.pop(session_id, None)
        self._wakeup.set()
