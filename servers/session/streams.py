"""The two live streams: a session's events (replay, then live) and pending sessions.

StreamEvents subscribes to the hub *before* replaying from storage, so an event committed
during the replay is either read by the replay or buffered by the watcher; the stream then
drops anything at or below the last seq it delivered and rereads storage across any gap, so
the reader sees every seq exactly once, in order ([SESSION-STREAM-001]).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from oma.servers.session import events as ev
from oma.servers.session.hub import Hub
from oma.servers.session.store import SessionStore
from oma.session.v1 import events_pb2, session_service_pb2

_PAGE = 500
_TERMINATED = "session.status_terminated"


class _Cursor:
    """Delivers stored events strictly in seq order, reading storage to fill gaps."""

    def __init__(self, store: SessionStore, session_id: str, after_seq: int) -> None:
        self.store = store
        self.session_id = session_id
        self.delivered = after_seq
        self.finished = False

    async def from_storage(self, before_seq: int = 0) -> AsyncIterator[events_pb2.Event]:
        """Everything after `delivered` (and below `before_seq` if set) that storage holds."""
        while not self.finished:
            rows = await self.store.read_events(
                self.session_id, after_seq=self.delivered, before_seq=before_seq, limit=_PAGE
            )
            for seq, body in rows:
                if seq != self.delivered + 1:
                    # Cannot happen with a gapless log; refuse to paper over it.
                    raise RuntimeError(
                        f"session {self.session_id}: seq {seq} follows {self.delivered}"
                    )
                event = events_pb2.Event.FromString(body)
                yield self.mark(event)
                if self.finished:
                    return
            if len(rows) < _PAGE:
                return

    def mark(self, event: events_pb2.Event) -> events_pb2.Event:
        self.delivered = event.seq
        if event.type == _TERMINATED:
            self.finished = True
        return event


def _event(event: events_pb2.Event) -> session_service_pb2.StreamEventsResponse:
    return session_service_pb2.StreamEventsResponse(event=event)


async def stream_events(
    store: SessionStore, hub: Hub, session_id: str, after_seq: int, follow: bool
) -> AsyncIterator[session_service_pb2.StreamEventsResponse]:
    state = await store.get_session(session_id)  # NOT_FOUND before anything is sent
    cursor = _Cursor(store, session_id, max(0, after_seq))
    if not follow or state.status == ev.STATUS_TERMINATED:
        async for event in cursor.from_storage(before_seq=state.last_seq + 1):
            yield _event(event)
        return
    watcher = hub.watch_events(session_id)
    try:
        async for event in cursor.from_storage():
            yield _event(event)
        while not cursor.finished:
            item = await watcher.get()
            if item is None:  # dropped something: catch up from storage
                async for event in cursor.from_storage():
                    yield _event(event)
            elif isinstance(item, events_pb2.Event):
                if item.seq <= cursor.delivered:
                    continue
                if item.seq > cursor.delivered + 1:
                    # A gap (an out-of-order fan-out): storage holds the missing events and
                    # this one, all committed before this one was announced.
                    async for event in cursor.from_storage():
                        yield _event(event)
                    continue
                yield _event(cursor.mark(item))
            else:
                if item.after_seq > cursor.delivered:
                    async for event in cursor.from_storage(before_seq=item.after_seq + 1):
                        yield _event(event)
                if not cursor.finished:
                    yield session_service_pb2.StreamEventsResponse(preview=item)
    finally:
        hub.unwatch(watcher)


async def watch_pending(
    store: SessionStore, hub: Hub
) -> AsyncIterator[session_service_pb2.WatchPendingSessionsResponse]:
    watcher = hub.watch_pending()
    try:
        snapshot = True
        while True:
            if snapshot:
                snapshot = False
                for session_id, last_seq in await store.pending_sessions():
                    yield session_service_pb2.WatchPendingSessionsResponse(
                        session_id=session_id, last_seq=last_seq
                    )
            item = await watcher.get()
            if item is None:  # dropped pushes: the snapshot covers them
                snapshot = True
                continue
            yield item
    finally:
        hub.unwatch(watcher)
