"""The append hot path's own promises, below gRPC: what the store announces and stores."""

from __future__ import annotations

import asyncio
from pathlib import Path

from session_helpers import user_message

from oma.servers.session import events as ev
from oma.servers.session.database import open_database
from oma.servers.session.hub import Hub
from oma.servers.session.store import SessionStore
from oma.session.v1 import definition_pb2, events_pb2

# Hang protection only, never a speed check.
PATIENCE = 60.0


async def test_sqlite_append_cancelled_after_submission_is_still_announced(
    tmp_path: Path,
) -> None:
    """On SQLite a transaction handed to the writer thread runs to commit; its watchers hear
    of it even when the appender is cancelled while waiting (a committed event is never
    missing from a live stream)."""
    db = await open_database(f"sqlite:///{tmp_path / 'sessions.db'}")
    store = SessionStore(db)
    hub = Hub(store)
    await hub.start()
    try:
        state, _ = await store.create_session(definition_pb2.SessionDefinition(model="m"), "")
        watcher = hub.watch_events(state.id)
        batch = ev.prepare_batch(
            [user_message("late", "e-1")], may_write_harness_events=False, limits=store.limits
        )
        task = asyncio.create_task(
            store.append(state.id, batch, expected_last_seq=None, fencing_token=0)
        )
        await asyncio.sleep(0)  # the task runs up to its wait for the writer thread
        task.cancel()
        item = await asyncio.wait_for(watcher.get(), PATIENCE)
        assert isinstance(item, events_pb2.Event)
        assert (item.id, item.seq, item.type) == ("e-1", 2, "user.message")
        stored = await store.read_events(state.id, after_seq=1)
        assert [seq for seq, _ in stored] == [2]
    finally:
        await hub.close()
        await db.close()


async def test_stored_body_is_the_event_with_server_fields(tmp_path: Path) -> None:
    """A writer's event is stored with the server's type, seq and create_time, and nothing
    else changed, whether or not it sent output-only fields."""
    db = await open_database(f"sqlite:///{tmp_path / 'sessions.db'}")
    store = SessionStore(db)
    try:
        state, _ = await store.create_session(definition_pb2.SessionDefinition(model="m"), "")
        clean = user_message("clean", "e-1")
        clean.turn_id = "turn-7"
        dirty = user_message("dirty", "e-2")
        dirty.seq, dirty.type = 40, "agent.message"
        dirty.create_time.nanos = 5  # merged, not replaced, if it were left in the body
        batch = ev.prepare_batch(
            [clean, dirty], may_write_harness_events=False, limits=store.limits
        )
        await store.append(state.id, batch, expected_last_seq=None, fencing_token=0)
        stored = [events_pb2.Event.FromString(b) for _, b in await store.read_events(state.id)]
        first, second = stored[1], stored[2]
        assert (first.id, first.seq, first.type, first.turn_id) == (
            "e-1",
            2,
            "user.message",
            "turn-7",
        )
        assert first.user_message.content[0].text == "clean"
        assert (second.id, second.seq, second.type) == ("e-2", 3, "user.message")
        assert second.create_time == first.create_time  # one stamp per batch, the server's
        assert second.create_time.ToMicroseconds() > 0
    finally:
        await db.close()
