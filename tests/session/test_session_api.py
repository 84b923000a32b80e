"""The session contract's unary RPCs: creation, reads, the append check order, limits, status."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import grpc
import pytest
from session_helpers import agent_message, definition, idle, new_session, user_message

from oma.runtime.errors import error_info
from oma.servers.session.server import SessionServer
from oma.session.v1 import definition_pb2, events_pb2
from oma.session.v1 import session_service_pb2 as pb
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub


async def expect_error(call: object, code: grpc.StatusCode, reason: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    assert caught.value.code() == code, caught.value.details()
    info = error_info(caught.value)
    assert info is not None and info.reason == reason, (info, caught.value.details())
    assert info.domain == "oma.dev"
    return caught.value


async def test_capabilities(client: SessionServiceStub) -> None:
    """Requirements tested: SESSION-CAP-001."""
    info = (await client.GetCapabilities(pb.GetCapabilitiesRequest())).server_info
    assert "oma.session.v1" in info.api_versions
    for limit in ("max_event_bytes", "max_batch_events", "max_batch_bytes", "max_lease_ttl_ms"):
        assert info.limits[f"session.{limit}"] > 0
    assert {"session.previews", "session.watch_pending"} <= set(info.features)


async def test_create_records_definition_as_first_event(client: SessionServiceStub) -> None:
    """Requirements tested: SESSION-CREATE-003, SESSION-EVENT-001."""
    request = definition(team="a")
    request.definition.tools.add(
        name="bash", permission_policy=definition_pb2.PERMISSION_POLICY_ALWAYS_ASK
    )
    request.definition.environment.files.add(path="x.txt", content=b"\x00\x01", mode=0o600)
    request.definition.vault_credential_ids.append("cred_1")
    session = (await client.CreateSession(request)).session
    assert session.id.startswith("ses_") and session.last_seq == 1
    assert session.status == pb.SESSION_STATUS_IDLE
    assert session.definition == request.definition
    events = (await client.GetEvents(pb.GetEventsRequest(session_id=session.id))).events
    assert [e.seq for e in events] == [1]
    assert events[0].type == "session.created"
    assert events[0].session_created.definition == request.definition
    assert events[0].create_time.seconds > 0
    fetched = (await client.GetSession(pb.GetSessionRequest(session_id=session.id))).session
    assert fetched == session


async def test_create_is_idempotent_by_request_id(client: SessionServiceStub) -> None:
    """Requirements tested: SESSION-CREATE-001, SESSION-CREATE-002."""
    request = definition()
    request.request_id = "req-" + uuid.uuid4().hex
    first = (await client.CreateSession(request)).session
    again = (await client.CreateSession(request)).session
    assert again.id == first.id
    other = definition()
    other.request_id = request.request_id
    other.definition.model = "another-model"
    await expect_error(
        client.CreateSession(other), grpc.StatusCode.ALREADY_EXISTS, "REQUEST_ID_REUSED"
    )
    listed = (await client.ListSessions(pb.ListSessionsRequest())).sessions
    assert [s.id for s in listed] == [first.id]


async def test_create_rejects_bad_definitions(client: SessionServiceStub) -> None:
    bad = definition()
    bad.definition.model = ""
    error = await expect_error(
        client.CreateSession(bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"
    )
    assert error_info(error).metadata["field"] == "definition.model"  # type: ignore[union-attr]
    bad = definition()
    bad.definition.tools.add(name="rm-rf")
    await expect_error(client.CreateSession(bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    bad = definition()
    bad.definition.custom_tools.add(name="lookup", input_schema_json="[1]")
    await expect_error(client.CreateSession(bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    bad = definition()
    bad.request_id = "has space"
    await expect_error(client.CreateSession(bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD")
    assert not (await client.ListSessions(pb.ListSessionsRequest())).sessions


async def test_unknown_and_malformed_session_ids(client: SessionServiceStub) -> None:
    await expect_error(
        client.GetSession(pb.GetSessionRequest(session_id="ses_missing")),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )
    await expect_error(
        client.GetEvents(pb.GetEventsRequest(session_id="ses_missing")),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )
    await expect_error(
        client.AppendEvents(
            pb.AppendEventsRequest(session_id="ses_missing", events=[user_message("x")])
        ),
        grpc.StatusCode.NOT_FOUND,
        "SESSION_NOT_FOUND",
    )
    await expect_error(
        client.GetSession(pb.GetSessionRequest(session_id="bad id/")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    stream = client.StreamEvents(pb.StreamEventsRequest(session_id="ses_missing", follow=True))
    await expect_error(stream.read(), grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")


async def test_list_sessions_pages_and_filters(client: SessionServiceStub) -> None:
    ids = [await new_session(client, team="red" if i % 2 else "blue") for i in range(7)]
    seen: list[str] = []
    token = ""
    while True:
        page = await client.ListSessions(pb.ListSessionsRequest(page_size=3, page_token=token))
        assert len(page.sessions) <= 3
        seen += [s.id for s in page.sessions]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids
    red = (await client.ListSessions(pb.ListSessionsRequest(labels={"team": "red"}))).sessions
    assert [s.id for s in red] == ids[1::2]
    await expect_error(
        client.ListSessions(pb.ListSessionsRequest(page_token="garbage")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )


async def test_append_assigns_consecutive_seqs(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    first = await client.AppendEvents(
        pb.AppendEventsRequest(session_id=sid, events=[user_message("a"), user_message("b")])
    )
    assert list(first.seqs) == [2, 3] and first.last_seq == 3 and not first.replayed
    events = (await client.GetEvents(pb.GetEventsRequest(session_id=sid))).events
    assert [(e.seq, e.type) for e in events] == [
        (1, "session.created"),
        (2, "user.message"),
        (3, "user.message"),
    ]
    assert events[1].user_message.content[0].text == "a"


async def test_append_output_only_fields_are_the_servers(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    event = user_message("hello")
    event.seq, event.type = 99, "agent.message"
    event.create_time.seconds = 1
    await client.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=[event]))
    stored = (await client.GetEvents(pb.GetEventsRequest(session_id=sid, after_seq=1))).events[0]
    assert (stored.seq, stored.type) == (2, "user.message")
    assert stored.create_time.seconds > 1


async def test_append_retry_returns_original_seqs(client: SessionServiceStub) -> None:
    """Requirements tested: SESSION-APPEND-002, SESSION-APPEND-003."""
    sid = await new_session(client)
    batch = [user_message("a", "e-1"), user_message("b", "e-2")]
    first = await client.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=batch))
    await client.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=[user_message("c")]))
    # A retry succeeds even with a now-stale expected_last_seq: dedupe comes first.
    retry = await client.AppendEvents(
        pb.AppendEventsRequest(session_id=sid, events=batch, expected_last_seq=1)
    )
    assert retry.replayed and list(retry.seqs) == list(first.seqs) and retry.last_seq == 4
    reordered = await client.AppendEvents(
        pb.AppendEventsRequest(session_id=sid, events=[batch[1], batch[0]])
    )
    assert list(reordered.seqs) == [3, 2]
    await expect_error(
        client.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[batch[0], user_message("new")])
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "MIXED_BATCH",
    )
    assert (await client.GetSession(pb.GetSessionRequest(session_id=sid))).session.last_seq == 4


async def test_append_expected_last_seq(client: SessionServiceStub) -> None:
    """Requirements tested: SESSION-APPEND-005."""
    sid = await new_session(client)
    ok = await client.AppendEvents(
        pb.AppendEventsRequest(session_id=sid, events=[user_message("a")], expected_last_seq=1)
    )
    assert list(ok.seqs) == [2]
    error = await expect_error(
        client.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[user_message("b")], expected_last_seq=1)
        ),
        grpc.StatusCode.ABORTED,
        "SEQUENCE_MISMATCH",
    )
    assert error_info(error).metadata["last_seq"] == "2"  # type: ignore[union-attr]


async def test_append_validation(client: SessionServiceStub, harness: SessionServiceStub) -> None:
    sid = await new_session(client)

    async def refused(
        events: list[events_pb2.Event], reason: str, stub: SessionServiceStub = client
    ) -> None:
        await expect_error(
            stub.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=events)),
            grpc.StatusCode.INVALID_ARGUMENT,
            reason,
        )

    await refused([], "INVALID_FIELD")
    await refused([user_message("a", "same"), user_message("b", "same")], "INVALID_FIELD")
    await refused([user_message("a", "bad id!")], "INVALID_EVENT_ID")
    await refused([user_message("a", "x" * 129)], "INVALID_EVENT_ID")
    await refused([events_pb2.Event(id="no-payload")], "INVALID_EVENT")
    await refused(
        [events_pb2.Event(id="sc", session_created=events_pb2.SessionCreated())], "INVALID_EVENT"
    )
    # A client may not write harness events, whatever fencing token it sends.
    await refused([agent_message("pretend")], "INVALID_EVENT")
    tool_use = events_pb2.Event(
        id="tu", agent_tool_use=events_pb2.AgentToolUse(name="bash", input_json="{}")
    )
    await refused([tool_use], "INVALID_EVENT", harness)  # no tool_use_id
    tool_use.tool_use_id = "toolu_1"
    tool_use.agent_tool_use.input_json = "not json"
    await refused([tool_use], "INVALID_EVENT", harness)
    end = events_pb2.Event(id="end", session_status_terminated=events_pb2.SessionStatusTerminated())
    await refused([end, agent_message("after the end")], "INVALID_EVENT", harness)
    await refused([user_message("x" * (2 << 20))], "EVENT_TOO_LARGE")
    await refused([user_message(str(i)) for i in range(1001)], "BATCH_TOO_LARGE")
    await refused([user_message("x" * (900 << 10)) for _ in range(4)], "BATCH_TOO_LARGE")
    # Nothing was written by any of them.
    assert (await client.GetSession(pb.GetSessionRequest(session_id=sid))).session.last_seq == 1


async def test_harness_events_need_the_live_lease(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    sid = await new_session(client)
    await expect_error(
        harness.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=[agent_message("x")])),
        grpc.StatusCode.ABORTED,
        "LEASE_LOST",
    )
    lease = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="worker-1"))
    ).lease
    assert lease.fencing_token >= 1 and lease.holder_id == "worker-1"
    await expect_error(
        harness.AppendEvents(
            pb.AppendEventsRequest(
                session_id=sid, events=[agent_message("x")], fencing_token=lease.fencing_token + 1
            )
        ),
        grpc.StatusCode.ABORTED,
        "LEASE_LOST",
    )
    ok = await harness.AppendEvents(
        pb.AppendEventsRequest(
            session_id=sid, events=[agent_message("x")], fencing_token=lease.fencing_token
        )
    )
    assert list(ok.seqs) == [2]
    # User events need no lease even while a harness holds one.
    await client.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=[user_message("stop")]))
    await harness.ReleaseLease(
        pb.ReleaseLeaseRequest(session_id=sid, fencing_token=lease.fencing_token)
    )
    await expect_error(
        harness.AppendEvents(
            pb.AppendEventsRequest(
                session_id=sid, events=[agent_message("y")], fencing_token=lease.fencing_token
            )
        ),
        grpc.StatusCode.ABORTED,
        "LEASE_LOST",
    )


async def test_clients_cannot_use_harness_rpcs(client: SessionServiceStub) -> None:
    sid = await new_session(client)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await client.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="me"))
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_status_follows_status_events(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    sid = await new_session(client)
    lease = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))
    ).lease

    async def write(event: events_pb2.Event) -> pb.Session:
        await harness.AppendEvents(
            pb.AppendEventsRequest(
                session_id=sid, events=[event], fencing_token=lease.fencing_token
            )
        )
        return (await client.GetSession(pb.GetSessionRequest(session_id=sid))).session

    running = events_pb2.Event(id="r", session_status_running=events_pb2.SessionStatusRunning())
    assert (await write(running)).status == pb.SESSION_STATUS_RUNNING
    waiting = events_pb2.Event(
        id="i",
        session_status_idle=events_pb2.SessionStatusIdle(
            stop_reason=events_pb2.STOP_REASON_REQUIRES_ACTION
        ),
    )
    session = await write(waiting)
    assert session.status == pb.SESSION_STATUS_IDLE
    assert session.stop_reason == events_pb2.STOP_REASON_REQUIRES_ACTION
    resched = events_pb2.Event(
        id="rs", session_status_rescheduled=events_pb2.SessionStatusRescheduled()
    )
    assert (await write(resched)).status == pb.SESSION_STATUS_RESCHEDULING
    end = events_pb2.Event(id="t", session_status_terminated=events_pb2.SessionStatusTerminated())
    assert (await write(end)).status == pb.SESSION_STATUS_TERMINATED
    # Terminated: nothing more, from anyone; but a retry of the terminating batch still succeeds.
    await expect_error(
        client.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=[user_message("hi")])),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SESSION_TERMINATED",
    )
    retry = await harness.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=[end]))
    assert retry.replayed and list(retry.seqs) == [5]
    await expect_error(
        harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w2")),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SESSION_TERMINATED",
    )


async def test_idle_needs_a_stop_reason(
    client: SessionServiceStub, harness: SessionServiceStub
) -> None:
    sid = await new_session(client)
    lease = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))
    ).lease
    bad = idle()
    bad.session_status_idle.stop_reason = events_pb2.STOP_REASON_UNSPECIFIED
    await expect_error(
        harness.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[bad], fencing_token=lease.fencing_token)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_EVENT",
    )


async def test_get_events_slices(client: SessionServiceStub, harness: SessionServiceStub) -> None:
    sid = await new_session(client)
    lease = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))
    ).lease
    for i in range(5):
        await client.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=[user_message(str(i))])
        )
        await harness.AppendEvents(
            pb.AppendEventsRequest(
                session_id=sid, events=[agent_message(str(i))], fencing_token=lease.fencing_token
            )
        )
    last3 = await client.GetEvents(
        pb.GetEventsRequest(session_id=sid, order=pb.EVENT_ORDER_DESCENDING, page_size=3)
    )
    assert [e.seq for e in last3.events] == [11, 10, 9] and last3.next_page_token
    window = await client.GetEvents(pb.GetEventsRequest(session_id=sid, after_seq=3, before_seq=7))
    assert [e.seq for e in window.events] == [4, 5, 6] and not window.next_page_token
    agents = await client.GetEvents(pb.GetEventsRequest(session_id=sid, types=["agent.message"]))
    assert [e.seq for e in agents.events] == [3, 5, 7, 9, 11]
    await expect_error(
        client.GetEvents(pb.GetEventsRequest(session_id=sid, types=["agent.nonsense"])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    # A token belongs to its query.
    await expect_error(
        client.GetEvents(pb.GetEventsRequest(session_id=sid, page_token=last3.next_page_token)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )


async def test_server_reports_capability_limits_it_enforces(
    server: SessionServer, stub_for: Callable[..., SessionServiceStub]
) -> None:
    client = stub_for(server, "client")
    info = (await client.GetCapabilities(pb.GetCapabilitiesRequest())).server_info
    assert info.limits["session.max_batch_events"] == server.store.limits.max_batch_events


async def test_pages_stop_at_a_byte_budget(client: SessionServiceStub) -> None:
    """Big events: a page holds fewer than page_size of them but paging still returns all."""
    sid = await new_session(client)
    for i in range(4):  # 12 events of 800 KiB: more than one 8 MiB page
        batch = [user_message(f"{i}.{j}" + "x" * (800 << 10)) for j in range(3)]
        await client.AppendEvents(pb.AppendEventsRequest(session_id=sid, events=batch))
    seqs, pages, token = [], 0, ""
    while True:
        page = await client.GetEvents(
            pb.GetEventsRequest(session_id=sid, page_size=1000, page_token=token)
        )
        pages += 1
        seqs += [e.seq for e in page.events]
        token = page.next_page_token
        if not token:
            break
    assert seqs == list(range(1, 14)) and pages >= 2


async def test_concurrent_creates_with_one_request_id(client: SessionServiceStub) -> None:
    """Requirements tested: SESSION-CREATE-001 (under concurrency)."""
    import asyncio

    request = definition()
    request.request_id = "same-" + uuid.uuid4().hex
    sessions = await asyncio.gather(*(client.CreateSession(request) for _ in range(10)))
    assert len({s.session.id for s in sessions}) == 1
    assert len((await client.ListSessions(pb.ListSessionsRequest())).sessions) == 1
