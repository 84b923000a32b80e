"""HarnessService checks. They need the session service of the same deployment (give
`--session` too): sessions are created there and leases taken there to set the scene."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from oma.conformance.checks._util import expect_error, unique
from oma.conformance.registry import check
from oma.conformance.target import Target
from oma.harness.v1 import harness_pb2 as pb
from oma.session.v1 import definition_pb2
from oma.session.v1 import session_service_pb2 as session_pb


def _wake(target: Target, session_id: str) -> Any:
    return target.stub("harness", "client").Wake(pb.WakeRequest(session_id=session_id))


async def _session_without_input(target: Target) -> tuple[str, Any]:
    assert "session" in target.addresses, "harness checks need --session of the same deployment"
    sessions = target.stub("session", "client")
    created = await sessions.CreateSession(session_pb.CreateSessionRequest(
        definition=definition_pb2.SessionDefinition(model="conformance-model")))
    return str(created.session.id), sessions


async def _last_seq(sessions: Any, session_id: str) -> int:
    got = await sessions.GetSession(session_pb.GetSessionRequest(session_id=session_id))
    return int(got.session.last_seq)


@check("harness", "HARNESS-WAKE-003")
async def check_a_session_without_input_is_nothing_to_do(target: Target) -> None:
    session_id, sessions = await _session_without_input(target)
    before = await _last_seq(sessions, session_id)
    response = await _wake(target, session_id)
    assert response.outcome == pb.WAKE_OUTCOME_NOTHING_TO_DO, response
    assert await _last_seq(sessions, session_id) == before, "a wake with nothing to do appended"
    # The lease taken to look was released: another holder can take it at once.
    lease = await target.stub("session", "harness").AcquireLease(session_pb.AcquireLeaseRequest(
        session_id=session_id, holder_id=unique("probe"), ttl=Duration(seconds=5)))
    assert lease.lease.fencing_token > 0


@check("harness", "HARNESS-WAKE-002")
async def check_a_session_driven_elsewhere_is_left_alone(target: Target) -> None:
    session_id, sessions = await _session_without_input(target)
    holder = unique("other-harness")
    await target.stub("session", "harness").AcquireLease(session_pb.AcquireLeaseRequest(
        session_id=session_id, holder_id=holder, ttl=Duration(seconds=30)))
    before = await _last_seq(sessions, session_id)
    response = await _wake(target, session_id)
    assert response.outcome == pb.WAKE_OUTCOME_ALREADY_DRIVEN, response
    assert response.holder_id == holder, response.holder_id
    assert await _last_seq(sessions, session_id) == before


@check("harness", "HARNESS-WAKE-004")
async def check_wake_of_an_unknown_session_is_not_found(target: Target) -> None:
    await expect_error(_wake(target, unique("no-such-session")),
                       grpc.StatusCode.NOT_FOUND, "SESSION_NOT_FOUND")
