"""Helpers shared by the session tests (builders for requests and events)."""

from __future__ import annotations

import uuid

from oma.session.v1 import events_pb2
from oma.session.v1 import session_service_pb2 as pb
from oma.session.v1.session_service_pb2_grpc import SessionServiceStub


def definition(**labels: str) -> pb.CreateSessionRequest:
    from oma.session.v1 import definition_pb2

    return pb.CreateSessionRequest(
        definition=definition_pb2.SessionDefinition(
            model="claude-test", system_prompt="be brief", labels=labels
        )
    )


async def new_session(stub: SessionServiceStub, **labels: str) -> str:
    response = await stub.CreateSession(definition(**labels))
    return response.session.id


def user_message(text: str, event_id: str | None = None) -> events_pb2.Event:
    return events_pb2.Event(
        id=event_id or uuid.uuid4().hex,
        user_message=events_pb2.UserMessage(content=[events_pb2.ContentBlock(text=text)]),
    )


def agent_message(text: str, event_id: str | None = None) -> events_pb2.Event:
    return events_pb2.Event(
        id=event_id or uuid.uuid4().hex,
        agent_message=events_pb2.AgentMessage(content=[events_pb2.ContentBlock(text=text)]),
    )


def idle(event_id: str | None = None) -> events_pb2.Event:
    return events_pb2.Event(
        id=event_id or uuid.uuid4().hex,
        session_status_idle=events_pb2.SessionStatusIdle(
            stop_reason=events_pb2.STOP_REASON_END_TURN
        ),
    )
