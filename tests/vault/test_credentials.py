"""Credential management: write-only secrets, metadata, roles, rotation, deletion, paging,
and encryption at rest (the database alone reveals nothing)."""

from __future__ import annotations

import os
import sqlite3
import stat

import grpc
import pytest
from vault_calls import create, expect_error, hosts, issue

from oma.vault.v1 import vault_pb2 as pb

SECRET = "tok-" + "Zq7" * 8


def bearer(token: str = SECRET) -> pb.CredentialSecret:
    return pb.CredentialSecret(bearer=pb.BearerSecret(token=token))


async def test_capabilities_for_every_role(vault) -> None:
    for role in ("client", "harness", "sandbox_server", "admin"):
        caps = await vault.stub(role).GetCapabilities(pb.GetCapabilitiesRequest())
        assert "oma.vault.v1" in caps.server_info.api_versions
        assert "vault.proxy_stream" in caps.server_info.features
        assert caps.server_info.limits["vault.max_response_bytes"] > 0
        assert pb.CREDENTIAL_KIND_OAUTH in caps.credential_kinds


async def test_metadata_never_holds_the_secret(vault) -> None:
    stub = vault.stub()
    kinds = {
        "b": bearer(),
        "h": pb.CredentialSecret(header=pb.HeaderSecret(header_name="X-Api-Key", value=SECRET)),
        "u": pb.CredentialSecret(basic=pb.BasicSecret(username="alice", password=SECRET)),
        "g": pb.CredentialSecret(git_token=pb.GitTokenSecret(token=SECRET)),
        "o": pb.CredentialSecret(
            oauth=pb.OAuthSecret(
                access_token=SECRET,
                refresh_token=SECRET + "r",
                client_secret=SECRET + "c",
                token_endpoint="http://127.0.0.1:9/token",
                client_id="cid",
            )
        ),
    }
    for cid, secret in kinds.items():
        cred = await create(
            stub, secret, hosts(("api.example.com", 443)), credential_id=cid, description="test"
        )
        assert cred.version == 1
        assert SECRET.encode() not in cred.SerializeToString()
    listed = await stub.ListCredentials(pb.ListCredentialsRequest())
    assert [c.credential_id for c in listed.credentials] == sorted(kinds)
    assert SECRET.encode() not in listed.SerializeToString()
    by_id = {c.credential_id: c for c in listed.credentials}
    assert by_id["h"].header_name == "X-Api-Key"
    assert by_id["u"].username == "alice"
    assert by_id["o"].client_id == "cid"
    assert by_id["g"].kind == pb.CREDENTIAL_KIND_GIT_TOKEN


async def test_database_and_key_file_reveal_nothing(vault) -> None:
    await create(vault.stub(), bearer(), hosts(("api.example.com", 0)), credential_id="c1")
    db_path = vault.db_url.split("///", 1)[1]
    assert not _files_contain([db_path, db_path + "-wal"], SECRET.encode())
    mode = stat.S_IMODE(os.stat(vault.key_file).st_mode)
    assert mode == 0o600
    with sqlite3.connect(db_path) as conn:
        (ciphertext,) = conn.execute(
            "SELECT ciphertext FROM vault_credentials WHERE credential_id='c1'"
        ).fetchone()
    assert SECRET.encode() not in ciphertext


def _files_contain(paths: list[str], needle: bytes) -> bool:
    return any(os.path.exists(p) and needle in open(p, "rb").read() for p in paths)


async def test_ciphertext_is_bound_to_credential_and_version(vault) -> None:
    from cryptography.exceptions import InvalidTag

    stub = vault.stub()
    await create(stub, bearer(), hosts(("a.example", 0)), credential_id="one")
    await create(stub, bearer(SECRET + "2"), hosts(("a.example", 0)), credential_id="two")
    one = await vault.vault.store.get_credential("one")
    with pytest.raises(InvalidTag):
        vault.vault.keyring.open(one.sealed, "two", 1)
    with pytest.raises(InvalidTag):
        vault.vault.keyring.open(one.sealed, "one", 2)
    assert SECRET.encode() in vault.vault.keyring.open(one.sealed, "one", 1)


async def test_admin_only_management(vault) -> None:
    request = pb.CreateCredentialRequest(allowed_hosts=hosts(("a.example", 0)), secret=bearer())
    for role in ("client", "harness", "sandbox_server"):
        await expect_error(
            vault.stub(role).CreateCredential(request),
            grpc.StatusCode.PERMISSION_DENIED,
            "ROLE_FORBIDDEN",
        )
        await expect_error(
            vault.stub(role).ListAudit(pb.ListAuditRequest()),
            grpc.StatusCode.PERMISSION_DENIED,
            "ROLE_FORBIDDEN",
        )
    await expect_error(
        vault.stub("none").CreateCredential(request),
        grpc.StatusCode.UNAUTHENTICATED,
        "TOKEN_MISSING",
    )


async def test_harness_cannot_issue_without_session_check(vault) -> None:
    await create(vault.stub(), bearer(), hosts(("a.example", 0)), credential_id="c")
    await expect_error(
        vault.stub("harness").IssueSessionToken(
            pb.IssueSessionTokenRequest(session_id="s", credential_ids=["c"])
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_FORBIDDEN",
    )


async def test_invalid_create_requests(vault) -> None:
    stub = vault.stub()
    await expect_error(
        create(stub, bearer(), []), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD"
    )
    await expect_error(
        create(stub, bearer("short"), hosts(("a.example", 0))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    await expect_error(
        create(stub, bearer(), hosts(("a.example", 0)), credential_id="Bad Id"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    await expect_error(
        create(stub, bearer(), hosts(("*.example.com", 0))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    await expect_error(
        stub.CreateCredential(pb.CreateCredentialRequest(allowed_hosts=hosts(("a.example", 0)))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    header = pb.CredentialSecret(header=pb.HeaderSecret(header_name="Host", value=SECRET))
    await expect_error(
        create(stub, header, hosts(("a.example", 0))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )
    await create(stub, bearer(), hosts(("a.example", 0)), credential_id="dup")
    await expect_error(
        create(stub, bearer(), hosts(("a.example", 0)), credential_id="dup"),
        grpc.StatusCode.ALREADY_EXISTS,
        "CREDENTIAL_EXISTS",
    )


async def test_create_is_retry_safe_by_request_id(vault) -> None:
    stub = vault.stub()
    first = await create(stub, bearer(), hosts(("a.example", 0)), request_id="r-1")
    again = await create(stub, bearer(), hosts(("a.example", 0)), request_id="r-1")
    assert first.credential_id == again.credential_id
    assert first.credential_id.startswith("cred_")
    listed = await stub.ListCredentials(pb.ListCredentialsRequest())
    assert len(listed.credentials) == 1
    await expect_error(
        create(stub, bearer(SECRET + "x"), hosts(("a.example", 0)), request_id="r-1"),
        grpc.StatusCode.ALREADY_EXISTS,
        "REQUEST_ID_REUSED",
    )


async def test_rotate_and_delete(vault) -> None:
    stub = vault.stub()
    await create(stub, bearer(), hosts(("a.example", 0)), credential_id="c")
    rotated = await stub.RotateCredential(
        pb.RotateCredentialRequest(credential_id="c", secret=bearer(SECRET + "new"))
    )
    assert rotated.credential.version == 2
    record = await vault.vault.store.get_credential("c")
    assert (SECRET + "new").encode() in vault.vault.keyring.open(record.sealed, "c", 2)
    await expect_error(
        stub.RotateCredential(
            pb.RotateCredentialRequest(
                credential_id="c", secret=pb.CredentialSecret(basic=pb.BasicSecret(password=SECRET))
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "CREDENTIAL_KIND_MISMATCH",
    )
    await expect_error(
        stub.RotateCredential(pb.RotateCredentialRequest(credential_id="nope", secret=bearer())),
        grpc.StatusCode.NOT_FOUND,
        "CREDENTIAL_NOT_FOUND",
    )
    await stub.DeleteCredential(pb.DeleteCredentialRequest(credential_id="c"))
    await expect_error(
        stub.DeleteCredential(pb.DeleteCredentialRequest(credential_id="c")),
        grpc.StatusCode.NOT_FOUND,
        "CREDENTIAL_NOT_FOUND",
    )
    await expect_error(issue(stub, "s", "c"), grpc.StatusCode.NOT_FOUND, "CREDENTIAL_NOT_FOUND")


async def test_list_pages_and_foreign_page_token(vault) -> None:
    stub = vault.stub()
    ids = [f"c{i:02d}" for i in range(7)]
    for cid in ids:
        await create(stub, bearer(SECRET + cid), hosts(("a.example", 0)), credential_id=cid)
    seen: list[str] = []
    token = ""
    while True:
        page = await stub.ListCredentials(pb.ListCredentialsRequest(page_size=3, page_token=token))
        assert len(page.credentials) <= 3
        seen += [c.credential_id for c in page.credentials]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids
    await expect_error(
        stub.ListCredentials(pb.ListCredentialsRequest(page_token="forged")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )


async def test_key_from_environment_cannot_rotate(tmp_path) -> None:
    import base64

    from oma.servers.vault.crypto import Keyring

    key = base64.b64encode(os.urandom(32)).decode()
    keyring = Keyring.load(tmp_path / "unused.key", environ={"OMA_VAULT_MASTER_KEY": key})
    assert keyring.external
    assert not (tmp_path / "unused.key").exists()
