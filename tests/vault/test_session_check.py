"""A harness may issue session tokens only for credentials its session's definition lists,
checked against a real session service (`oma serve vault --session ADDR`)."""

from __future__ import annotations

from pathlib import Path

import grpc
from vault_calls import create, expect_error, hosts
from vault_server import start_vault, stop_vault

from oma.vault.v1 import vault_pb2 as pb


async def test_harness_issues_tokens_for_listed_credentials_only(tmp_path: Path) -> None:
    from oma.runtime.auth import TokenTable
    from oma.runtime.client import connect
    from oma.runtime.server import ServerOptions
    from oma.servers.session.server import SessionServer
    from oma.session.v1 import definition_pb2
    from oma.session.v1 import session_service_pb2 as spb
    from oma.session.v1.session_service_pb2_grpc import SessionServiceStub

    tokens = TokenTable.generate()
    sessions = await SessionServer.start(
        f"sqlite:///{tmp_path / 'sessions.db'}", ServerOptions(tokens=tokens, grace_seconds=0.5)
    )
    vault = await start_vault(tmp_path, session_address=sessions.address, tokens=tokens)
    try:
        async with connect(sessions.address, token=tokens.token_for("client")) as channel:
            created = await SessionServiceStub(channel).CreateSession(
                spb.CreateSessionRequest(
                    definition=definition_pb2.SessionDefinition(
                        model="claude-test",
                        vault_credential_ids=["listed"],
                        mcp_servers=[
                            definition_pb2.McpServer(
                                name="m",
                                url="https://mcp.example/mcp",
                                vault_credential_id="mcp-cred",
                            )
                        ],
                    )
                )
            )
        session_id = created.session.id
        admin = vault.stub()
        for cid in ("listed", "mcp-cred", "unlisted"):
            await create(
                admin,
                pb.CredentialSecret(bearer=pb.BearerSecret(token=f"{cid}-0123456789")),
                hosts(("api.example.com", 0)),
                credential_id=cid,
            )
        caps = await vault.stub("harness").GetCapabilities(pb.GetCapabilitiesRequest())
        assert "vault.harness_token_issue" in caps.server_info.features
        harness = vault.stub("harness")
        issued = await harness.IssueSessionToken(
            pb.IssueSessionTokenRequest(
                session_id=session_id, credential_ids=["listed", "mcp-cred"]
            )
        )
        assert issued.session_token.startswith("omavst_")
        await expect_error(
            harness.IssueSessionToken(
                pb.IssueSessionTokenRequest(
                    session_id=session_id, credential_ids=["listed", "unlisted"]
                )
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "CREDENTIAL_NOT_GRANTED",
        )
        await expect_error(
            harness.IssueSessionToken(
                pb.IssueSessionTokenRequest(
                    session_id="ses_00000000000000000000000000", credential_ids=["listed"]
                )
            ),
            grpc.StatusCode.NOT_FOUND,
            "SESSION_NOT_FOUND",
        )
        # An admin is trusted without the check.
        await admin.IssueSessionToken(
            pb.IssueSessionTokenRequest(session_id=session_id, credential_ids=["unlisted"])
        )
    finally:
        await stop_vault(vault)
        await sessions.stop(0.5)
