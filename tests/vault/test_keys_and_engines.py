"""Master-key rotation while proxying, PostgreSQL as the store, and `oma serve vault`."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
from pathlib import Path

import grpc
from vault_calls import create, expect_error, hosts, issue, proxy
from vault_server import start_vault, stop_vault
from vault_upstreams import MARKER

from oma.vault.v1 import vault_pb2 as pb


def bearer(token: str) -> pb.CredentialSecret:
    return pb.CredentialSecret(bearer=pb.BearerSecret(token=token))


async def test_proxying_keeps_working_while_the_master_key_rotates(vault, echo_server) -> None:
    from oma.servers.vault.crypto import Keyring

    stub = vault.stub()
    ids = [f"c{i}" for i in range(25)]
    for cid in ids:
        await create(
            stub, bearer(f"secret-{cid}-0123456789"), hosts(("127.0.0.1", 0)), credential_id=cid
        )
    token = await issue(stub, "ses_r", *ids)
    old_key_id = vault.vault.keyring.current_id
    done = asyncio.Event()
    warmed_up = asyncio.Event()
    results: list[int] = []
    failures: list[BaseException] = []

    async def proxy_loop() -> None:
        i = 0
        while not done.is_set() or len(results) < 10:
            cid = ids[i % len(ids)]
            try:
                response = await proxy(
                    vault.stub("harness"), token, cid, f"{echo_server.base}/forms"
                )
                assert MARKER.encode() in response.body
                assert f"secret-{cid}".encode() not in response.body
                results.append(response.status_code)
                if len(results) >= 3:
                    warmed_up.set()
            except BaseException as exc:  # the test reports every failure below
                failures.append(exc)
                warmed_up.set()
                return
            i += 1

    loops = [asyncio.create_task(proxy_loop()) for _ in range(3)]
    await warmed_up.wait()
    before = len(results)
    first = await stub.RotateMasterKey(pb.RotateMasterKeyRequest())
    # A credential rotation racing a master-key rotation stays consistent too.
    rotating = asyncio.ensure_future(
        stub.RotateCredential(
            pb.RotateCredentialRequest(credential_id="c0", secret=bearer("secret-c0-0123456789"))
        )
    )
    second = await stub.RotateMasterKey(pb.RotateMasterKeyRequest())
    await rotating
    done.set()
    await asyncio.gather(*loops)
    assert failures == []
    assert len(results) > before and set(results) == {200}
    assert first.reencrypted_count == len(ids)
    assert first.key_id != old_key_id and second.key_id != first.key_id
    # Only the newest key remains on disk, and it opens every secret (as after a restart).
    lines = [line for line in vault.key_file.read_text().splitlines() if line]
    assert len(lines) == 1
    assert stat.S_IMODE(os.stat(vault.key_file).st_mode) == 0o600
    fresh = Keyring.load(vault.key_file, environ={})
    assert fresh.current_id == second.key_id
    for cid in ids:
        record = await vault.vault.store.get_credential(cid)
        assert record.sealed.key_id == second.key_id
        assert f"secret-{cid}".encode() in fresh.open(record.sealed, cid, record.info.version)
    audit = await stub.ListAudit(pb.ListAuditRequest())
    assert sum(r.action == "rotate_master_key" for r in audit.records) == 2


async def test_postgresql_store(tmp_path: Path, pg_database: str, echo_server) -> None:
    url = pg_database.replace("postgresql://", "postgresql+asyncpg://", 1)
    v = await start_vault(tmp_path, db_url=url)
    try:
        stub = v.stub()
        await create(
            stub,
            bearer("pg-secret-0123456789"),
            hosts(("127.0.0.1", echo_server.port)),
            credential_id="pg",
        )
        token = await issue(stub, "ses_pg", "pg")
        response = await proxy(v.stub("harness"), token, "pg", f"{echo_server.base}/forms")
        assert response.status_code == 200 and b"pg-secret" not in response.body
        await v.stub("harness").RevokeSessionTokens(
            pb.RevokeSessionTokensRequest(session_id="ses_pg")
        )
        await expect_error(
            proxy(v.stub("harness"), token, "pg", f"{echo_server.base}/forms"),
            grpc.StatusCode.UNAUTHENTICATED,
            "SESSION_TOKEN_INVALID",
        )
        rotated = await stub.RotateMasterKey(pb.RotateMasterKeyRequest())
        assert rotated.reencrypted_count == 1
        audit = await stub.ListAudit(pb.ListAuditRequest(page_size=2))
        assert len(audit.records) == 2 and audit.next_page_token
    finally:
        await stop_vault(v)


async def test_oma_serve_vault_uses_the_data_dir(tmp_path: Path) -> None:
    from oma.runtime.auth import TokenTable
    from oma.runtime.client import connect
    from oma.vault.v1 import vault_pb2_grpc

    home = tmp_path / "oma-home"
    env = {**os.environ, "OMA_HOME": str(home)}
    env.pop("OMA_VAULT_MASTER_KEY", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "oma.cli.main",
        "serve",
        "vault",
        "--listen",
        "127.0.0.1:0",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
        assert "serving on" in line, line
        address = line.rsplit(" ", 1)[1].strip()
        tokens = TokenTable.load(home / "tokens.json")
        async with connect(address, token=tokens.token_for("client")) as channel:
            caps = await vault_pb2_grpc.VaultServiceStub(channel).GetCapabilities(
                pb.GetCapabilitiesRequest()
            )
        assert "vault.master_key_rotation" in caps.server_info.features
        assert stat.S_IMODE(os.stat(home / "vault.key").st_mode) == 0o600
        assert (home / "vault.db").exists()
    finally:
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 30) == 0


async def test_environment_key_rotates_by_restart(tmp_path: Path, echo_server) -> None:
    import base64

    from oma.servers.vault.core import Vault
    from oma.servers.vault.crypto import Keyring
    from oma.servers.vault.models import AllowedHost, CredentialKind, Secret
    from oma.servers.vault.store import VaultStore

    old, new = (base64.b64encode(os.urandom(32)).decode() for _ in range(2))
    url = f"sqlite+aiosqlite:///{tmp_path / 'env.db'}"
    store = VaultStore(url)
    await store.initialize()
    first = Vault(store, Keyring.load(tmp_path / "x.key", environ={"OMA_VAULT_MASTER_KEY": old}))
    for i in range(3):
        await first.create_credential(
            actor="admin",
            credential_id=f"e{i}",
            secret=Secret(CredentialKind.BEARER, token=f"env-secret-{i}-xx"),
            allowed_hosts=[AllowedHost("127.0.0.1")],
        )
    await first.close()

    store = VaultStore(url)
    environ = {"OMA_VAULT_MASTER_KEY": new, "OMA_VAULT_PREVIOUS_MASTER_KEYS": old}
    second = Vault(store, Keyring.load(tmp_path / "x.key", environ=environ))
    try:
        count, unreadable = await second.reencrypt_stale()
        assert (count, unreadable) == (3, [])
        assert not (tmp_path / "x.key").exists()
        only_new = Keyring.load(tmp_path / "x.key", environ={"OMA_VAULT_MASTER_KEY": new})
        for i in range(3):
            record = await store.get_credential(f"e{i}")
            assert record.sealed.key_id == only_new.current_id
            assert f"env-secret-{i}".encode() in only_new.open(record.sealed, f"e{i}", 1)
        await expect_error_domain(second)
    finally:
        await second.close()


async def expect_error_domain(vault) -> None:
    from oma.servers.vault.errors import VaultError

    try:
        await vault.rotate_master_key(actor="admin")
    except VaultError as exc:
        assert exc.reason == "MASTER_KEY_EXTERNAL"
    else:
        raise AssertionError("an environment key cannot be rotated online")
