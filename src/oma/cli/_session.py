"""One prompt, end to end, as a client: create a session, say something, wake the harness,
and render the session's events live until the turn is idle."""

from __future__ import annotations

import asyncio
import uuid

from oma.cli._render import Renderer
from oma.cli._stack import StackInfo

SANDBOX_TOOLS = ("bash", "read", "write", "edit", "glob", "grep")


class TurnFailed(Exception):
    """The session could not be started or did not reach idle."""


async def run_prompt(
    info: StackInfo,
    prompt: str,
    *,
    model: str,
    system: str = "",
    tools: tuple[str, ...] = SANDBOX_TOOLS,
    renderer: Renderer,
    timeout_seconds: float = 600.0,
    destroy_sandboxes: bool = False,
) -> str:
    """Returns the session id once the turn is idle; `renderer.stop_reason` says how it ended."""
    import grpc

    from oma.harness.v1 import harness_pb2, harness_pb2_grpc
    from oma.runtime.auth import TokenTable
    from oma.runtime.client import connect
    from oma.session.v1 import (
        definition_pb2,
        events_pb2,
        session_service_pb2,
        session_service_pb2_grpc,
    )

    token = TokenTable.load(info.tokens_file).token_for("client")
    async with (
        connect(info.session, token=token) as session_channel,
        connect(info.harness, token=token) as harness_channel,
    ):
        sessions = session_service_pb2_grpc.SessionServiceStub(session_channel)
        harness = harness_pb2_grpc.HarnessServiceStub(harness_channel)
        definition = definition_pb2.SessionDefinition(
            model=model,
            system_prompt=system,
            tools=[definition_pb2.BuiltinTool(name=t) for t in tools],
        )
        created = await sessions.CreateSession(
            session_service_pb2.CreateSessionRequest(
                request_id=uuid.uuid4().hex, definition=definition
            ),
            timeout=30,
        )
        session_id = created.session.id
        appended = await sessions.AppendEvents(
            session_service_pb2.AppendEventsRequest(
                session_id=session_id,
                events=[
                    events_pb2.Event(
                        id=f"user-{uuid.uuid4().hex}",
                        user_message=events_pb2.UserMessage(
                            content=[events_pb2.ContentBlock(text=prompt)]
                        ),
                    )
                ],
            ),
            timeout=30,
        )
        user_seq = appended.seqs[0]

        async def watch() -> None:
            stream = sessions.StreamEvents(
                session_service_pb2.StreamEventsRequest(
                    session_id=session_id, after_seq=0, follow=True
                )
            )
            async for item in stream:
                renderer.handle(item)
                if (
                    item.WhichOneof("item") == "event"
                    and item.event.WhichOneof("payload") == "session_status_idle"
                    and item.event.seq > user_seq
                ):
                    stream.cancel()
                    return

        watcher = asyncio.create_task(watch())
        try:
            woken = await harness.Wake(harness_pb2.WakeRequest(session_id=session_id), timeout=60)
            if woken.outcome == harness_pb2.WAKE_OUTCOME_NOTHING_TO_DO:
                raise TurnFailed(f"the harness found nothing to do in session {session_id}")
            await asyncio.wait_for(watcher, timeout_seconds)
        except grpc.aio.AioRpcError as error:
            raise TurnFailed(f"{error.code().name}: {error.details()}") from error
        except TimeoutError as error:
            raise TurnFailed(
                f"session {session_id} did not go idle within {timeout_seconds:.0f}s"
            ) from error
        finally:
            watcher.cancel()
            if destroy_sandboxes:
                await _destroy_sandboxes(info, session_id)
        return session_id


async def _destroy_sandboxes(info: StackInfo, session_id: str) -> None:
    """Tear down a one-shot session's sandboxes (they would outlive a stopped stack)."""
    import grpc

    from oma.runtime.auth import TokenTable
    from oma.runtime.client import connect
    from oma.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc

    token = TokenTable.load(info.tokens_file).token_for("admin")
    async with connect(info.sandbox, token=token) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        try:
            listed = await stub.ListSandboxes(
                sandbox_pb2.ListSandboxesRequest(label_selector={"oma.dev/session-id": session_id}),
                timeout=30,
            )
            for sandbox in listed.sandboxes:
                await stub.DestroySandbox(
                    sandbox_pb2.DestroySandboxRequest(sandbox_id=sandbox.id), timeout=60
                )
        except grpc.aio.AioRpcError:
            pass  # best effort: the sandbox server reaps idle sandboxes on its own
