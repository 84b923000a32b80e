"""WatchPendingSessions: a snapshot, then pushes when sessions come to need a harness."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from google.protobuf import duration_pb2
from session_helpers import idle, new_session, user_message

from oma.runtime.auth import TokenTable
from oma.runtime.server import ServerOptions
from oma.servers.session.server import SessionServer
from oma.session.v1 import session_service_pb2 as pb
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub

PATIENCE = 60.0  # hang protection only


async def next_id(stream: grpc.aio.UnaryStreamCall) -> str:
    item = await asyncio.wait_for(stream.read(), PATIENCE)
    assert item is not grpc.aio.EOF
    return item.session_id


async def ids_until(stream: grpc.aio.UnaryStreamCall, wanted: set[str], ignore: set[str]) -> None:
    """Read pushes until every wanted id came; an id may be pushed more than once
    ([SESSION-PENDING-001]), so repeats of wanted or ignored ids are skipped."""
    missing = set(wanted)
    while missing:
        pushed = await next_id(stream)
        assert pushed in wanted | ignore, f"unexpected push {pushed}"
        missing.discard(pushed)


async def say(stub: SessionServiceStub, sid: str, text: str = "hi") -> None:
    await stub.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=[user_message(text)]))


async def test_snapshot_then_live_pushes(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    waiting = await new_session(client)
    await say(client, waiting)
    await new_session(client)  # no input: not pending
    leased = await new_session(client)
    await say(client, leased)
    await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=leased, holder_id="busy"))

    stream = harness.WatchPendingSessions(pb.WatchPendingSessionsRequest())
    assert await next_id(stream) == waiting  # the snapshot: only the unleased one with input
    fresh = await new_session(client)
    await say(client, fresh)
    assert await next_id(stream) == fresh
    stream.cancel()


async def test_push_when_a_lease_is_released_or_expires(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    released = await new_session(client)
    expiring = await new_session(client)
    finished = await new_session(client)
    for sid in (released, expiring, finished):
        await say(client, sid)
    leases = {}
    for sid, ttl in ((released, 30), (expiring, 0), (finished, 30)):
        duration = duration_pb2.Duration(seconds=ttl, nanos=0 if ttl else 300_000_000)
        leases[sid] = (
            await harness.AcquireLease(
                pb.AcquireLeaseRequest(session_id=sid, holder_id="w", ttl=duration)
            )
        ).lease.fencing_token

    stream = harness.WatchPendingSessions(pb.WatchPendingSessionsRequest())
    # The finished turn writes idle, then releases: nothing pending, no push.
    await harness.AppendEvents(
        pb.AppendEventsRequest(session_id=finished, events=[idle()], fencing_token=leases[finished])
    )
    await harness.ReleaseLease(
        pb.ReleaseLeaseRequest(session_id=finished, fencing_token=leases[finished])
    )
    # A harness that gives up without finishing releases: the input is still unprocessed.
    await harness.ReleaseLease(
        pb.ReleaseLeaseRequest(session_id=released, fencing_token=leases[released])
    )
    # A harness that dies: its lease runs out and the session is pushed, without any poll.
    # (Which comes first, and whether a slow machine already had the expired one in the
    # snapshot, depends on the machine's speed.)
    await ids_until(stream, {released, expiring}, set())
    taken = await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=expiring, holder_id="w2"))
    assert taken.lease.fencing_token > leases[expiring]
    # A user message after idle makes the finished session pending again.
    await say(client, finished, "one more thing")
    await ids_until(stream, {finished}, {released, expiring})
    stream.cancel()


async def test_pending_push_across_servers(
    pg_database: str, tokens: TokenTable, stub_for: Callable[..., SessionServiceStub]
) -> None:
    # Cross-server push rides PostgreSQL LISTEN/NOTIFY; SQLite is single-server.
    url = pg_database.replace("postgresql://", "postgresql+asyncpg://", 1)
    options = ServerOptions(tokens=tokens, grace_seconds=0.5)
    one = await SessionServer.start(url, options)
    two = await SessionServer.start(url, options)
    try:
        a, b = stub_for(one, "harness"), stub_for(two, "harness")
        stream = b.WatchPendingSessions(pb.WatchPendingSessionsRequest())
        sid = await new_session(a)
        await say(a, sid)
        assert await next_id(stream) == sid
        lease = (await a.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))).lease
        await a.ReleaseLease(
            pb.ReleaseLeaseRequest(session_id=sid, fencing_token=lease.fencing_token)
        )
        assert await next_id(stream) == sid
        stream.cancel()
    finally:
        await one.stop(0.5)
        await two.stop(0.5)
