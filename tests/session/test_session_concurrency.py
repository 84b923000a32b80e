"""Concurrent appenders, retries and lease holders: seqs stay gapless and fencing holds."""

from __future__ import annotations

import asyncio
import uuid

import grpc
from google.protobuf import duration_pb2
from session_helpers import agent_message, new_session, user_message

from oma.runtime.errors import error_info
from oma.session.v1 import session_service_pb2 as pb
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub


async def all_events(stub: SessionServiceStub, sid: str) -> list:
    out = []
    token = ""
    while True:
        page = await stub.GetEvents(
            pb.GetEventsRequest(session_id=sid, page_size=1000, page_token=token)
        )
        out += list(page.events)
        token = page.next_page_token
        if not token:
            return out


async def test_concurrent_appenders_get_gapless_seqs(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    writers, per_writer = 16, 12

    async def writer(w: int) -> list[int]:
        seqs = []
        for i in range(per_writer):
            batch = [user_message(f"{w}-{i}-{j}", f"w{w}-{i}-{j}") for j in range(1 + (i % 3))]
            response = await client.AppendEvents(
                pb.AppendEventsRequest(session_id=sid, events=batch)
            )
            # A batch's seqs are consecutive.
            assert list(response.seqs) == list(
                range(response.seqs[0], response.seqs[0] + len(batch))
            )
            seqs += list(response.seqs)
        return seqs

    results = await asyncio.gather(*(writer(w) for w in range(writers)))
    acknowledged = sorted(s for seqs in results for s in seqs)
    total = sum(1 + (i % 3) for i in range(per_writer)) * writers
    assert acknowledged == list(range(2, 2 + total))
    events = await all_events(client, sid)
    assert [e.seq for e in events] == list(range(1, 2 + total))
    # Each writer's own events are stored in the order it wrote them.
    for w in range(writers):
        mine = [e.id for e in events if e.id.startswith(f"w{w}-")]
        assert mine == sorted(mine, key=lambda i: (int(i.split("-")[1]), int(i.split("-")[2])))


async def test_concurrent_appenders_with_expected_last_seq(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    writers, appends_each = 8, 5
    conflicts = 0

    async def writer(w: int) -> None:
        nonlocal conflicts
        done = 0
        while done < appends_each:
            last = (await client.GetSession(pb.GetSessionRequest(session_id=sid))).session.last_seq
            try:
                response = await client.AppendEvents(
                    pb.AppendEventsRequest(
                        session_id=sid,
                        events=[user_message(f"{w}-{done}", f"w{w}-{done}")],
                        expected_last_seq=last,
                    )
                )
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.ABORTED
                info = error_info(exc)
                assert info is not None and info.reason == "SEQUENCE_MISMATCH"
                assert int(info.metadata["last_seq"]) > last
                conflicts += 1
                continue
            # Optimistic concurrency: success means nobody wrote in between.
            assert list(response.seqs) == [last + 1]
            done += 1

    await asyncio.gather(*(writer(w) for w in range(writers)))
    events = await all_events(client, sid)
    assert [e.seq for e in events] == list(range(1, 2 + writers * appends_each))


async def test_concurrent_retries_of_one_batch_append_it_once(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    batch = [user_message(str(i), f"retry-{i}") for i in range(5)]
    responses = await asyncio.gather(
        *(
            client.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=batch))
            for _ in range(10)
        )
    )
    assert {tuple(r.seqs) for r in responses} == {(2, 3, 4, 5, 6)}
    assert sum(not r.replayed for r in responses) == 1
    assert [e.seq for e in await all_events(client, sid)] == list(range(1, 7))


async def test_stale_lease_holder_is_fenced_off(harness: SessionServiceStub) -> None:
    sid = await new_session(harness)
    short = duration_pb2.Duration(nanos=200_000_000)
    first = (
        await harness.AcquireLease(
            pb.AcquireLeaseRequest(session_id=sid, holder_id="old", ttl=short)
        )
    ).lease
    # While it is live, another holder is refused and told whose it is.
    try:
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="new"))
        raise AssertionError("a live lease was granted twice")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
        info = error_info(exc)
        assert info is not None and info.reason == "LEASE_HELD"
        assert info.metadata["holder_id"] == "old"
    # Acquiring again as the same holder is idempotent: same token.
    again = (
        await harness.AcquireLease(
            pb.AcquireLeaseRequest(session_id=sid, holder_id="old", ttl=short)
        )
    ).lease
    assert again.fencing_token == first.fencing_token
    # Wait for the lease to expire (checked against the server, not a timer in the test).
    while True:
        try:
            second = (
                await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="new"))
            ).lease
            break
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)
    assert second.fencing_token > first.fencing_token
    for stale_call in (
        harness.AppendEvents(
            pb.AppendEventsRequest(
                session_id=sid, events=[agent_message("late")], fencing_token=first.fencing_token
            )
        ),
        harness.RenewLease(pb.RenewLeaseRequest(session_id=sid, fencing_token=first.fencing_token)),
    ):
        try:
            await stale_call
            raise AssertionError("a stale fencing token was accepted")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.ABORTED
            assert error_info(exc).reason == "LEASE_LOST"  # type: ignore[union-attr]
    # Releasing a stale token is a harmless no-op; the live lease still works.
    await harness.ReleaseLease(
        pb.ReleaseLeaseRequest(session_id=sid, fencing_token=first.fencing_token)
    )
    ok = await harness.AppendEvents(
        pb.AppendEventsRequest(
            session_id=sid, events=[agent_message("mine")], fencing_token=second.fencing_token
        )
    )
    assert list(ok.seqs) == [2]
    renewed = (
        await harness.RenewLease(
            pb.RenewLeaseRequest(session_id=sid, fencing_token=second.fencing_token)
        )
    ).lease
    assert renewed.fencing_token == second.fencing_token
    assert renewed.expire_time.ToMicroseconds() >= second.expire_time.ToMicroseconds()
    await harness.ReleaseLease(
        pb.ReleaseLeaseRequest(session_id=sid, fencing_token=second.fencing_token)
    )
    await harness.ReleaseLease(
        pb.ReleaseLeaseRequest(session_id=sid, fencing_token=second.fencing_token)
    )
    third = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="old"))
    ).lease
    assert third.fencing_token > second.fencing_token


async def test_racing_acquirers_get_one_lease(harness: SessionServiceStub) -> None:
    sid = await new_session(harness)

    async def acquire(holder: str) -> int | None:
        try:
            lease = await harness.AcquireLease(
                pb.AcquireLeaseRequest(session_id=sid, holder_id=holder)
            )
        except grpc.aio.AioRpcError as exc:
            assert error_info(exc).reason == "LEASE_HELD"  # type: ignore[union-attr]
            return None
        return lease.lease.fencing_token

    tokens = await asyncio.gather(*(acquire(f"h{i}") for i in range(12)))
    assert len([t for t in tokens if t is not None]) == 1


async def test_lease_ttl_limits(harness: SessionServiceStub) -> None:
    sid = await new_session(harness)
    try:
        await harness.AcquireLease(
            pb.AcquireLeaseRequest(
                session_id=sid, holder_id="h", ttl=duration_pb2.Duration(seconds=86400)
            )
        )
        raise AssertionError("an over-long ttl was accepted")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(exc).reason == "INVALID_FIELD"  # type: ignore[union-attr]


async def test_claim_mode_grants_each_pending_session_once(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    pending = set()
    for _ in range(4):
        sid = await new_session(client)
        await client.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[user_message("go")])
        )
        pending.add(sid)
    await new_session(client)  # no input: never claimed

    async def claim(worker: int) -> str | None:
        try:
            lease = await harness.AcquireLease(pb.AcquireLeaseRequest(holder_id=f"w{worker}"))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
            assert error_info(exc).reason == "NO_SESSION_PENDING"  # type: ignore[union-attr]
            return None
        return lease.lease.session_id

    claimed = [s for s in await asyncio.gather(*(claim(w) for w in range(8))) if s]
    assert sorted(claimed) == sorted(pending)
    assert await claim(99) is None


async def test_unique_ids_per_session_not_global(client: SessionServiceStub) -> None:
    a, b = await new_session(client), await new_session(client)
    same = "shared-" + uuid.uuid4().hex
    ra = await client.AppendEvents(
        pb.AppendEventsRequest(session_id=a, events=[user_message("x", same)])
    )
    rb = await client.AppendEvents(
        pb.AppendEventsRequest(session_id=b, events=[user_message("x", same)])
    )
    assert not ra.replayed and not rb.replayed
