"""StreamEvents: replay then live with no gap or duplicate, slow readers, previews, and
watchers on two servers sharing one PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from session_helpers import agent_message, new_session, user_message

from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.runtime.errors import error_info
from oma.runtime.server import ServerOptions
from oma.servers.session.server import SessionServer
from oma.session.v1 import events_pb2
from oma.session.v1 import session_service_pb2 as pb
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub

# Hang protection only (a stuck stream fails instead of blocking the suite), never a speed check.
PATIENCE = 60.0


async def collect_until(
    stream: grpc.aio.UnaryStreamCall, last_seq: int, previews: list | None = None
) -> list[int]:
    seqs: list[int] = []

    async def run() -> None:
        while True:
            item = await stream.read()
            assert item is not grpc.aio.EOF, f"stream ended after {seqs[-1:]}"
            if item.WhichOneof("item") == "preview":
                assert previews is not None, "preview on a stream that expected none"
                previews.append(item.preview)
                continue
            seqs.append(item.event.seq)
            if item.event.seq >= last_seq:
                return

    await asyncio.wait_for(run(), PATIENCE)
    stream.cancel()
    return seqs


async def test_replay_then_live_without_gap_or_duplicate(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    writers, per_writer = 4, 25
    total = 1 + writers * per_writer
    streams: list[grpc.aio.UnaryStreamCall] = []

    async def writer(w: int) -> None:
        for i in range(per_writer):
            await client.AppendEvents(
                pb.AppendEventsRequest(session_id=sid, events=[user_message(f"{w}.{i}")])
            )
            if w == 0 and i % 5 == 0:
                # Watchers join while appends race with their replay.
                streams.append(
                    client.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True))
                )
                streams.append(
                    client.StreamEvents(
                        pb.StreamEventsRequest(session_id=sid, after_seq=i, follow=True)
                    )
                )

    await asyncio.gather(*(writer(w) for w in range(writers)))
    results = await asyncio.gather(*(collect_until(s, total) for s in streams))
    for index, seqs in enumerate(results):
        start = 0 if index % 2 == 0 else (index // 2) * 5
        assert seqs == list(range(start + 1, total + 1))


async def test_without_follow_the_stream_ends(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    await client.AppendEvents(
        pb.AppendEventsRequest(session_id=sid, events=[user_message(str(i)) for i in range(3)])
    )
    items = [
        item
        async for item in client.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_seq=1))
    ]
    assert [i.event.seq for i in items] == [2, 3, 4]


async def test_slow_watcher_catches_up_without_stalling_appenders(
    server: SessionServer, client: SessionServiceStub, tokens: TokenTable
) -> None:
    server.hub.capacity = 4
    sid = await new_session(client)
    # Without BDP probing the slow reader's HTTP/2 window stays small, so flow control soon
    # holds the server's writes to it and its hub buffer fills.
    channel = connect(
        server.address, token=tokens.token_for("client"), options=[("grpc.http2.bdp_probe", 0)]
    )
    slow = SessionServiceStub(channel).StreamEvents(
        pb.StreamEventsRequest(session_id=sid, follow=True)
    )
    first = await asyncio.wait_for(slow.read(), PATIENCE)
    assert first.event.seq == 1
    fast = client.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True))
    fast_task = asyncio.create_task(collect_until(fast, 301))
    # 300 appends complete while the slow watcher reads nothing: it cannot hold them up.
    for i in range(100):
        await client.AppendEvents(
            pb.AppendEventsRequest(
                session_id=sid, events=[user_message(f"{i}.{j}" + "x" * 8000) for j in range(3)]
            )
        )
    rest = await collect_until(slow, 301)
    # The slow reader's buffer did overflow (flow control held its stream), so it reread storage.
    assert server.hub.overflows >= 1
    await channel.close()
    assert rest == list(range(2, 302))
    assert await fast_task == list(range(1, 302))


async def test_previews_reach_watchers_and_are_never_stored(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    sid = await new_session(client)
    lease = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))
    ).lease
    stream = client.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True))
    assert (await asyncio.wait_for(stream.read(), PATIENCE)).event.seq == 1
    for delta in ("Hel", "lo"):
        await harness.PublishPreview(
            pb.PublishPreviewRequest(
                session_id=sid,
                fencing_token=lease.fencing_token,
                preview=pb.Preview(after_seq=1, turn_id="t1", content_index=0, text_delta=delta),
            )
        )
    await harness.AppendEvents(
        pb.AppendEventsRequest(
            session_id=sid, events=[agent_message("Hello")], fencing_token=lease.fencing_token
        )
    )
    previews: list[pb.Preview] = []
    assert await collect_until(stream, 2, previews) == [2]
    assert [p.text_delta for p in previews] == ["Hel", "lo"]
    assert all(p.session_id == sid and p.after_seq == 1 and p.turn_id == "t1" for p in previews)
    stored = (await client.GetEvents(pb.GetEventsRequest(session_id=sid))).events
    assert [e.type for e in stored] == ["session.created", "agent.message"]
    try:
        await harness.PublishPreview(
            pb.PublishPreviewRequest(
                session_id=sid, fencing_token=lease.fencing_token + 7, preview=pb.Preview()
            )
        )
        raise AssertionError("a preview without the live lease was accepted")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.ABORTED
        assert error_info(exc).reason == "LEASE_LOST"  # type: ignore[union-attr]


async def test_stream_ends_after_termination(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    sid = await new_session(client)
    lease = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))
    ).lease
    stream = client.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True))
    end = events_pb2.Event(id="end", session_status_terminated=events_pb2.SessionStatusTerminated())
    await harness.AppendEvents(
        pb.AppendEventsRequest(session_id=sid, events=[end], fencing_token=lease.fencing_token)
    )

    async def drain() -> list[str]:
        return [item.event.type async for item in stream]

    assert await asyncio.wait_for(drain(), PATIENCE) == [
        "session.created",
        "session.status_terminated",
    ]
    # A follow stream on a terminated session replays and ends too.
    again = client.StreamEvents(pb.StreamEventsRequest(session_id=sid, after_seq=2, follow=True))
    assert [i async for i in again] == []


async def test_watchers_on_two_servers_sharing_postgresql(
    pg_database: str, tokens: TokenTable, stub_for: Callable[..., SessionServiceStub]
) -> None:
    # Cross-server fan-out is a PostgreSQL feature (LISTEN/NOTIFY); an embedded SQLite file
    # is served by one server, so this test runs on PostgreSQL only.
    url = pg_database.replace("postgresql://", "postgresql+asyncpg://", 1)
    options = ServerOptions(tokens=tokens, grace_seconds=0.5)
    one = await SessionServer.start(url, options)
    two = await SessionServer.start(url, options)
    try:
        a, b = stub_for(one, "harness"), stub_for(two, "harness")
        sid = await new_session(a)
        lease = (await b.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))).lease
        watchers = [
            b.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True)),
            a.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True)),
            b.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True)),
        ]
        for w in watchers:
            assert (await asyncio.wait_for(w.read(), PATIENCE)).event.seq == 1
        per_server = 40

        async def writer(stub: SessionServiceStub, name: str) -> None:
            for i in range(per_server):
                await stub.AppendEvents(
                    pb.AppendEventsRequest(session_id=sid, events=[user_message(f"{name}{i}")])
                )

        await asyncio.gather(writer(a, "a"), writer(b, "b"))
        await a.PublishPreview(
            pb.PublishPreviewRequest(
                session_id=sid,
                fencing_token=lease.fencing_token,
                preview=pb.Preview(after_seq=1 + 2 * per_server, text_delta="across"),
            )
        )
        await b.AppendEvents(
            pb.AppendEventsRequest(
                session_id=sid, events=[agent_message("done")], fencing_token=lease.fencing_token
            )
        )
        last = 2 + 2 * per_server
        for w in watchers:
            previews: list[pb.Preview] = []
            assert await collect_until(w, last, previews) == list(range(2, last + 1))
            assert [p.text_delta for p in previews] == ["across"]
    finally:
        await one.stop(0.5)
        await two.stop(0.5)


async def test_open_streams_end_cleanly_on_shutdown(
    db_url: str, tokens: TokenTable, stub_for: Callable[..., SessionServiceStub]
) -> None:
    """Requirements tested: COMMON-SHUTDOWN-001 (for the session's two live streams)."""
    server = await SessionServer.start(db_url, ServerOptions(tokens=tokens, grace_seconds=0.2))
    stub = stub_for(server, "harness")
    sid = await new_session(stub)
    events = stub.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True))
    pending = stub.WatchPendingSessions(pb.WatchPendingSessionsRequest())
    assert (await asyncio.wait_for(events.read(), PATIENCE)).event.seq == 1
    await asyncio.wait_for(server.stop(0.2), PATIENCE)
    for stream in (events, pending):
        try:
            while await asyncio.wait_for(stream.read(), PATIENCE) is not grpc.aio.EOF:
                pass
            raise AssertionError("a live stream ended without an error on shutdown")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert error_info(exc).reason == "SERVER_SHUTTING_DOWN"  # type: ignore[union-attr]
    assert not server.hub._event_watchers and not server.hub._pending_watchers


async def test_watcher_survives_a_lost_listen_connection(
    pg_database: str, tokens: TokenTable, stub_for: Callable[..., SessionServiceStub]
) -> None:
    """PostgreSQL only: when a server's LISTEN connection dies, notifications sent meanwhile
    are lost; the server reconnects and its watchers reread storage, so nothing is missed."""
    import psycopg

    url = pg_database.replace("postgresql://", "postgresql+asyncpg://", 1)
    options = ServerOptions(tokens=tokens, grace_seconds=0.5)
    one = await SessionServer.start(url, options)
    two = await SessionServer.start(url, options)
    try:
        a, b = stub_for(one, "harness"), stub_for(two, "harness")
        sid = await new_session(a)
        stream = b.StreamEvents(pb.StreamEventsRequest(session_id=sid, follow=True))
        assert (await asyncio.wait_for(stream.read(), PATIENCE)).event.seq == 1
        listener_pid = two.hub._listen_conn.get_server_pid()
        with psycopg.connect(pg_database, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (listener_pid,))
        for i in range(20):
            await a.AppendEvents(
                pb.AppendEventsRequest(session_id=sid, events=[user_message(str(i))])
            )
        assert await collect_until(stream, 21) == list(range(2, 22))
        assert two.hub._listen_conn.get_server_pid() != listener_pid
    finally:
        await one.stop(0.5)
        await two.stop(0.5)
