"""Fan-out of live changes to this server's watchers.

Sources: the store's listener callback for commits made through this server (events are
handed over as objects, no database read), and on PostgreSQL a `LISTEN` connection for
commits made through other servers (the notification names the session and the seq range;
the hub reads those rows once and fans them out to every local watcher of the session).

Watchers never block the hub: each has a bounded buffer; an event that does not fit sets
the watcher's `resync` flag and the watcher catches up from storage ([SESSION-STREAM-003]).
Pending-session watchers get session ids; lease expiries are tracked with timers so that a
session whose harness died is pushed when its lease runs out, not at the next poll.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections import deque
from typing import Any

from oma.servers.session.store import NOTIFY_CHANNEL, Change, SessionStore, now_us
from oma.session.v1 import events_pb2, session_service_pb2

logger = logging.getLogger("oma.session.hub")


class Watcher:
    """One live reader's bounded buffer. `get()` returns the next item, or None when the
    reader must resynchronize from storage (something was dropped)."""

    def __init__(self, key: str, capacity: int, hub: Hub | None = None) -> None:
        self.key = key
        self.capacity = capacity
        self.hub = hub
        self.resync = False
        self._items: deque[Any] = deque()
        self._ready = asyncio.Event()

    def offer(self, item: Any, *, droppable: bool = False) -> None:
        if len(self._items) >= self.capacity:
            if not droppable and not self.resync:
                self.resync = True
                self._ready.set()
                if self.hub is not None:
                    self.hub.overflows += 1
            return
        self._items.append(item)
        self._ready.set()

    def request_resync(self) -> None:
        self.resync = True
        self._ready.set()

    async def get(self) -> Any | None:
        while True:
            if self.resync:
                self.resync = False
                self._items.clear()
                return None
            if self._items:
                return self._items.popleft()
            self._ready.clear()
            await self._ready.wait()


class Hub:
    """Live watchers of session logs and of pending sessions, for one server process."""

    def __init__(self, store: SessionStore, *, watcher_capacity: int = 1024) -> None:
        self.store = store
        self.capacity = watcher_capacity
        self._event_watchers: dict[str, set[Watcher]] = {}
        self._pending_watchers: set[Watcher] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._remote: asyncio.Queue[str] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._listen_conn: Any = None
        self._closed = False
        self.overflows = 0  # times a watcher's buffer overflowed (it then reread storage)
        store.add_listener(self._on_local_change)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.store.db.is_sqlite:
            await self._connect_listener()
            self._tasks.append(asyncio.create_task(self._consume_remote()))
        for session_id, expire_us in await self.store.live_leases():
            self._schedule_expiry(session_id, expire_us)

    async def close(self) -> None:
        self._closed = True
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._listen_conn is not None:
            with contextlib.suppress(Exception):
                await self._listen_conn.close()

    async def _connect_listener(self) -> None:
        import asyncpg

        conn = await asyncpg.connect(self.store.db.asyncpg_dsn())
        await conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
        conn.add_termination_listener(self._on_listener_lost)
        self._listen_conn = conn

    def _on_listener_lost(self, _conn: Any) -> None:
        if self._closed:
            return
        logger.warning("LISTEN connection lost; reconnecting and resynchronizing watchers")
        self._tasks.append(asyncio.create_task(self._reconnect()))

    async def _reconnect(self) -> None:
        delay = 0.1
        while not self._closed:
            try:
                await self._connect_listener()
                break
            except Exception as exc:  # the database may be restarting
                logger.warning("LISTEN reconnect failed: %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        # Notifications sent while disconnected are lost: every watcher rereads storage.
        for watchers in self._event_watchers.values():
            for watcher in watchers:
                watcher.request_resync()
        for watcher in self._pending_watchers:
            watcher.request_resync()

    # -- subscriptions ------------------------------------------------------------------------

    def watch_events(self, session_id: str) -> Watcher:
        watcher = Watcher(session_id, self.capacity, self)
        self._event_watchers.setdefault(session_id, set()).add(watcher)
        return watcher

    def watch_pending(self) -> Watcher:
        watcher = Watcher("", self.capacity, self)
        self._pending_watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        if watcher.key:
            watchers = self._event_watchers.get(watcher.key)
            if watchers is not None:
                watchers.discard(watcher)
                if not watchers:
                    del self._event_watchers[watcher.key]
        else:
            self._pending_watchers.discard(watcher)

    # -- local changes (called synchronously right after commit) --------------------------------

    def _on_local_change(self, change: Change) -> None:
        watchers = self._event_watchers.get(change.session_id)
        if watchers and change.bodies:
            for event in change.events():  # parsed once, only when someone watches
                for watcher in watchers:
                    watcher.offer(event)
        self._consider_pending(change.session_id, change.state)

    def publish_preview(self, preview: session_service_pb2.Preview) -> None:
        for watcher in self._event_watchers.get(preview.session_id, ()):
            watcher.offer(preview, droppable=True)

    def _consider_pending(self, session_id: str, state: Any) -> None:
        now = now_us()
        if state.lease_live(now):
            self._schedule_expiry(session_id, state.lease_expire_us)
            return
        handle = self._timers.pop(session_id, None)
        if handle is not None:
            handle.cancel()
        if self._pending_watchers and state.needs_harness(now):
            item = session_service_pb2.WatchPendingSessionsResponse(
                session_id=session_id, last_seq=state.last_seq
            )
            for watcher in self._pending_watchers:
                watcher.offer(item)

    def _schedule_expiry(self, session_id: str, expire_us: int) -> None:
        loop = asyncio.get_running_loop()
        old = self._timers.pop(session_id, None)
        if old is not None:
            old.cancel()
        delay = max(0.0, (expire_us - now_us()) / 1e6) + 0.001
        self._timers[session_id] = loop.call_later(delay, self._on_expiry, session_id)

    def _on_expiry(self, session_id: str) -> None:
        self._timers.pop(session_id, None)
        if self._closed:
            return
        self._tasks.append(asyncio.create_task(self._recheck(session_id)))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _recheck(self, session_id: str) -> None:
        try:
            state = await self.store.get_session(session_id)
        except Exception as exc:
            logger.warning("rechecking session %s failed: %s", session_id, exc)
            return
        self._consider_pending(session_id, state)

    # -- remote changes (PostgreSQL NOTIFY from other servers) ----------------------------------

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self._remote.put_nowait(payload)

    async def _consume_remote(self) -> None:
        # One consumer, in notification order, so watchers mostly see events in seq order
        # (they still tolerate gaps and duplicates by rereading storage).
        while True:
            payload = await self._remote.get()
            try:
                await self._handle_remote(payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("handling notification %r failed: %s", payload[:80], exc)

    async def _handle_remote(self, payload: str) -> None:
        origin, kind, session_id, first, last, *rest = payload.split(" ")
        if origin == self.store.origin:
            return  # our own commit: already fanned out by _on_local_change
        if kind == "p":
            preview = session_service_pb2.Preview.FromString(base64.b64decode(rest[0]))
            self.publish_preview(preview)
            return
        if kind == "a":
            watchers = self._event_watchers.get(session_id)
            if watchers:
                rows = await self.store.read_events(
                    session_id,
                    after_seq=int(first) - 1,
                    before_seq=int(last) + 1,
                    limit=int(last) - int(first) + 1,
                )
                for _, body in rows:
                    event = events_pb2.Event.FromString(body)
                    for watcher in list(watchers):
                        watcher.offer(event)
        if self._pending_watchers or kind == "l":
            state = await self.store.get_session(session_id)
            self._consider_pending(session_id, state)
