"""SessionService checks: the append contract, positional reads, streaming and leases."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from oma.conformance.checks._util import expect_error, unique
from oma.conformance.registry import check
from oma.conformance.target import Target
from oma.session.v1 import definition_pb2, events_pb2
from oma.session.v1 import session_service_pb2 as pb


def _stub(target: Target, role: str = "client") -> Any:
    return target.stub("session", role)


async def _new_session(target: Target) -> str:
    definition = definition_pb2.SessionDefinition(model="conformance-model",
                                                  system_prompt="conformance")
    response = await _stub(target).CreateSession(pb.CreateSessionRequest(definition=definition))
    return str(response.session.id)


def _user_message(event_id: str, text: str = "hi") -> events_pb2.Event:
    return events_pb2.Event(id=event_id, user_message=events_pb2.UserMessage(
        content=[events_pb2.ContentBlock(text=text)]))


def _agent_message(event_id: str, text: str = "ok") -> events_pb2.Event:
    return events_pb2.Event(id=event_id, agent_message=events_pb2.AgentMessage(
        content=[events_pb2.ContentBlock(text=text)]))


async def _append(target: Target, session_id: str, events: list[events_pb2.Event],
                  **fields: Any) -> Any:
    return await _stub(target, fields.pop("role", "client")).AppendEvents(
        pb.AppendEventsRequest(session_id=session_id, events=events, **fields))


async def _all_events(target: Target, session_id: str, **fields: Any) -> list[Any]:
    events: list[Any] = []
    token = ""
    while True:
        page = await _stub(target).GetEvents(
            pb.GetEventsRequest(session_id=session_id, page_token=token, **fields))
        events.extend(page.events)
        token = page.next_page_token
        if not token:
            return events


@check("session", "SESSION-CREATE-001", "SESSION-CREATE-003")
async def check_create_is_idempotent_and_logs_its_definition(target: Target) -> None:
    request_id = unique("req")
    definition = definition_pb2.SessionDefinition(model="conformance-model", system_prompt="s")
    request = pb.CreateSessionRequest(request_id=request_id, definition=definition)
    first = await _stub(target).CreateSession(request)
    again = await _stub(target).CreateSession(request)
    assert first.session.id == again.session.id, "a repeated request_id created a second session"
    events = await _all_events(target, first.session.id)
    assert events and events[0].seq == 1 and events[0].type == "session.created", events[:1]
    assert events[0].session_created.definition.model == "conformance-model"


@check("session", "SESSION-GET-001")
async def check_unknown_session_is_not_found(target: Target) -> None:
    await expect_error(_stub(target).GetSession(pb.GetSessionRequest(session_id=unique("nope"))),
                       grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")


@check("session", "SESSION-APPEND-002", "SESSION-APPEND-008")
async def check_a_retried_batch_returns_its_original_seqs(target: Target) -> None:
    session_id = await _new_session(target)
    batch = [_user_message(unique("e")), _user_message(unique("e"))]
    first = await _append(target, session_id, batch)
    assert list(first.seqs) == [2, 3], f"seqs after session.created must be 2, 3: {first.seqs}"
    again = await _append(target, session_id, batch)
    assert list(again.seqs) == list(first.seqs)
    assert len(await _all_events(target, session_id)) == 3, "a retry appended again"


@check("session", "SESSION-APPEND-003")
async def check_a_mixed_batch_is_refused_whole(target: Target) -> None:
    session_id = await _new_session(target)
    known = _user_message(unique("e"))
    await _append(target, session_id, [known])
    await expect_error(_append(target, session_id, [known, _user_message(unique("e"))]),
                       grpc.StatusCode.INVALID_ARGUMENT, "MIXED_BATCH")
    assert len(await _all_events(target, session_id)) == 2, "part of a refused batch was written"


@check("session", "SESSION-APPEND-005")
async def check_expected_last_seq_mismatch_is_aborted(target: Target) -> None:
    session_id = await _new_session(target)
    await expect_error(
        _append(target, session_id, [_user_message(unique("e"))], expected_last_seq=7),
        grpc.StatusCode.ABORTED, "SEQUENCE_MISMATCH")
    ok = await _append(target, session_id, [_user_message(unique("e"))], expected_last_seq=1)
    assert list(ok.seqs) == [2]


@check("session", "SESSION-APPEND-006", "SESSION-APPEND-007", "SESSION-LEASE-002")
async def check_harness_events_need_the_current_fencing_token(target: Target) -> None:
    session_id = await _new_session(target)
    await expect_error(_append(target, session_id, [_agent_message(unique("a"))], role="harness"),
                       grpc.StatusCode.ABORTED, "LEASE_LOST")
    harness = _stub(target, "harness")
    first = await harness.AcquireLease(pb.AcquireLeaseRequest(
        session_id=session_id, holder_id="h1", ttl=Duration(seconds=30)))
    await harness.ReleaseLease(pb.ReleaseLeaseRequest(
        session_id=session_id, fencing_token=first.lease.fencing_token))
    second = await harness.AcquireLease(pb.AcquireLeaseRequest(
        session_id=session_id, holder_id="h2", ttl=Duration(seconds=30)))
    assert second.lease.fencing_token > first.lease.fencing_token, "fencing tokens must grow"
    await expect_error(
        _append(target, session_id, [_agent_message(unique("a"))], role="harness",
                fencing_token=first.lease.fencing_token),
        grpc.StatusCode.ABORTED, "LEASE_LOST")
    await _append(target, session_id, [_agent_message(unique("a"))], role="harness",
                  fencing_token=second.lease.fencing_token)
    # A user can always interrupt, lease or not.
    await _append(target, session_id, [_user_message(unique("u"))])


@check("session", "SESSION-LEASE-001")
async def check_a_live_lease_is_not_granted_twice(target: Target) -> None:
    session_id = await _new_session(target)
    harness = _stub(target, "harness")
    await harness.AcquireLease(pb.AcquireLeaseRequest(
        session_id=session_id, holder_id="h1", ttl=Duration(seconds=30)))
    await expect_error(harness.AcquireLease(pb.AcquireLeaseRequest(
        session_id=session_id, holder_id="h2", ttl=Duration(seconds=30))),
        grpc.StatusCode.FAILED_PRECONDITION, "LEASE_HELD")


@check("session", "SESSION-READ-001", "SESSION-READ-002")
async def check_positional_slices_and_pages(target: Target) -> None:
    session_id = await _new_session(target)
    await _append(target, session_id, [_user_message(f"m{i}") for i in range(10)])
    window = await _all_events(target, session_id, after_seq=3, before_seq=8, page_size=2)
    assert [e.seq for e in window] == [4, 5, 6, 7], [e.seq for e in window]
    everything = await _all_events(target, session_id, page_size=3)
    assert [e.seq for e in everything] == list(range(1, 12))


@check("session", "SESSION-STREAM-001", "SESSION-STREAM-002")
async def check_stream_replays_in_order_and_ends_without_follow(target: Target) -> None:
    session_id = await _new_session(target)
    await _append(target, session_id, [_user_message(f"m{i}") for i in range(5)])
    seqs = [item.event.seq async for item in _stub(target).StreamEvents(
        pb.StreamEventsRequest(session_id=session_id, after_seq=2, follow=False))
        if item.WhichOneof("item") == "event"]
    assert seqs == [3, 4, 5, 6], seqs
