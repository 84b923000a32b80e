"""Property tests: GetEvents slicing and paging agree with a plain list model of the log."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from session_helpers import agent_message, new_session, user_message

from oma.session.v1 import events_pb2
from oma.session.v1 import session_service_pb2 as pb
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub

TYPES = ["session.created", "user.message", "agent.message", "agent.thinking"]
EVENTS = 120


@dataclass
class Log:
    stub: SessionServiceStub
    session_id: str
    model: list[tuple[int, str]]  # (seq, type) in seq order


@pytest.fixture
async def log(client: SessionServiceStub, harness: SessionServiceStub) -> Log:
    sid = await new_session(client)
    lease = (
        await harness.AcquireLease(pb.AcquireLeaseRequest(session_id=sid, holder_id="w"))
    ).lease
    rng = random.Random(7)
    model = [(1, "session.created")]
    while len(model) < EVENTS:
        batch = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.choice(TYPES[1:])
            if kind == "user.message":
                batch.append(user_message("u"))
            elif kind == "agent.message":
                batch.append(agent_message("a"))
            else:
                batch.append(
                    events_pb2.Event(
                        id=f"t{len(model)}-{len(batch)}",
                        agent_thinking=events_pb2.AgentThinking(thinking="hmm"),
                    )
                )
        response = await harness.AppendEvents(
            pb.AppendEventsRequest(session_id=sid, events=batch, fencing_token=lease.fencing_token)
        )
        model += [(seq, e.type or _type(e)) for seq, e in zip(response.seqs, batch, strict=True)]
    return Log(client, sid, model)


def _type(event: events_pb2.Event) -> str:
    return (event.WhichOneof("payload") or "").replace("_", ".", 1)


queries = st.fixed_dictionaries(
    {
        "after_seq": st.integers(0, EVENTS + 5),
        "before_seq": st.integers(0, EVENTS + 5),
        "page_size": st.integers(0, 40),
        "descending": st.booleans(),
        "types": st.lists(st.sampled_from(TYPES), max_size=3, unique=True),
    }
)


@settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(query=queries)
async def test_get_events_paging_matches_list_model(log: Log, query: dict) -> None:
    expected = [
        seq
        for seq, kind in log.model
        if seq > query["after_seq"]
        and (query["before_seq"] == 0 or seq < query["before_seq"])
        and (not query["types"] or kind in query["types"])
    ]
    if query["descending"]:
        expected.reverse()
    page_size = query["page_size"] or 100
    request = pb.GetEventsRequest(
        session_id=log.session_id,
        after_seq=query["after_seq"],
        before_seq=query["before_seq"],
        page_size=query["page_size"],
        order=pb.EVENT_ORDER_DESCENDING if query["descending"] else pb.EVENT_ORDER_ASCENDING,
        types=query["types"],
    )
    # The first page is exactly the model's first slice.
    first = await log.stub.GetEvents(request)
    assert [e.seq for e in first.events] == expected[:page_size]
    assert bool(first.next_page_token) == (len(expected) > page_size)
    # Following the tokens yields the whole slice once, in order, in pages of at most page_size.
    got = [e.seq for e in first.events]
    token = first.next_page_token
    while token:
        request.page_token = token
        page = await log.stub.GetEvents(request)
        assert 0 < len(page.events) <= page_size
        got += [e.seq for e in page.events]
        token = page.next_page_token
    assert got == expected
    kinds = dict(log.model)
    assert all(kinds[e.seq] == e.type for e in first.events)
