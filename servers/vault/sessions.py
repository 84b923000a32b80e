"""Asking the session service which vault credentials a session's definition lists.

Used when a harness (not an admin) calls `IssueSessionToken`: the vault forwards the
harness's own bearer token to `SessionService.GetSession`, so it needs no token of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc


def session_lookup_factory(
    address: str,
) -> Callable[[str], Callable[[str], Awaitable[set[str] | None]]]:
    def for_token(bearer: str) -> Callable[[str], Awaitable[set[str] | None]]:
        async def lookup(session_id: str) -> set[str] | None:
            from oma.runtime.client import connect
            from oma.session.v1 import session_service_pb2, session_service_pb2_grpc

            async with connect(address, token=bearer or None) as channel:
                stub = session_service_pb2_grpc.SessionServiceStub(channel)
                try:
                    response = await stub.GetSession(
                        session_service_pb2.GetSessionRequest(session_id=session_id), timeout=10
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        return None
                    raise
            definition = response.session.definition
            listed = set(definition.vault_credential_ids)
            listed |= {
                m.vault_credential_id for m in definition.mcp_servers if m.vault_credential_id
            }
            listed |= {
                r.vault_credential_id
                for r in definition.environment.repositories
                if r.vault_credential_id
            }
            return listed

        return lookup

    return for_token
