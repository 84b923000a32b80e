"""The hostile-tool test: a script inside a provisioned sandbox (Docker and bubblewrap
backends) hunts for the secrets everywhere it can reach and finds nothing, while the same
secrets work through the vault's proxy in the same test.

The vault keeps its database and key in oma's default locations (`vault.db` and `vault.key`
in the data directory, here `$OMA_HOME` pointed at a temporary directory), the sandbox server
clones a private repository at provision time through the vault (`--vault`), and the session
token travels in the provision request — none of which may leave a trace in the sandbox.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest
from vault_calls import create, hosts, issue, proxy
from vault_server import start_vault, stop_vault
from vault_upstreams import MARKER, LoopbackServer, echo_app, git_server_app, make_bare_repository

from oma.vault.v1 import vault_pb2 as pb

HUNT = (Path(__file__).parent / "hunt.py").read_text()


def _hidden(secret: str) -> str:
    return secret.encode().hex()[::-1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["docker", "local"])
async def test_a_hostile_tool_finds_no_secret(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request.getfixturevalue("docker_client" if backend == "docker" else "bwrap_path")
    from oma.runtime.auth import TokenTable
    from oma.runtime.client import connect
    from oma.runtime.server import ServerOptions
    from oma.sandbox.v1 import sandbox_pb2 as spb
    from oma.sandbox.v1 import sandbox_pb2_grpc
    from oma.servers.sandbox.server import build_manager, start_sandbox_server
    from oma.servers.vault.cli import default_db_url, default_key_file
    from oma.servers.vault.fetcher import VaultRepositoryFetcher

    not_before = time.time() - 2
    git_token = "ghp_" + secrets.token_urlsafe(24)
    api_secret = "sk-" + secrets.token_urlsafe(24)
    home = tmp_path / "oma-home"
    home.mkdir()
    monkeypatch.setenv("OMA_HOME", str(home))

    root = tmp_path / "git-root"
    make_bare_repository(root, "private", {"README.md": "# private\n"})
    git_server = await LoopbackServer(git_server_app(root, "x-access-token", git_token)).start()
    echo = await LoopbackServer(echo_app(api_secret)).start()
    tokens = TokenTable.generate()  # one token table for the whole deployment, as `oma up`
    vault = await start_vault(
        tmp_path, db_url=default_db_url(), key_file=default_key_file(), tokens=tokens
    )
    fetcher = VaultRepositoryFetcher(vault.address, tokens.token_for("sandbox_server"))
    manager = build_manager(backend, tmp_path / "sandboxes", fetcher=fetcher)
    sandbox_server = await start_sandbox_server(manager, ServerOptions(tokens=tokens))
    channel = connect(sandbox_server.address, token=tokens.token_for("harness"))
    sandbox_id = ""
    try:
        admin = vault.stub()
        await create(
            admin,
            pb.CredentialSecret(git_token=pb.GitTokenSecret(token=git_token)),
            hosts(("127.0.0.1", git_server.port)),
            credential_id="gh",
        )
        await create(
            admin,
            pb.CredentialSecret(bearer=pb.BearerSecret(token=api_secret)),
            hosts(("127.0.0.1", echo.port)),
            credential_id="api",
        )
        session_token = await issue(admin, "ses_hostile", "gh", "api")
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        repo_url = f"{git_server.base}/private.git"
        provisioned = await stub.Provision(
            spb.ProvisionRequest(
                labels={"oma.dev/session-id": "ses_hostile"},
                init=spb.InitSteps(
                    repositories=[
                        spb.GitRepository(url=repo_url, path="private", credential_id="gh")
                    ],
                    files=[spb.InitFile(path="hunt.py", content=HUNT.encode())],
                ),
                vault_session_token=session_token,
            )
        )
        sandbox_id = provisioned.sandbox.id
        needles = ",".join(_hidden(s) for s in (git_token, api_secret, session_token))
        private = ",".join(
            str(p)
            for p in (
                default_key_file(),
                Path(default_db_url().split("///")[1]),
                home / "tokens.json",
            )
        )
        vault_port = vault.address.rsplit(":", 1)[1]
        targets = ",".join(
            [
                f"127.0.0.1:{vault_port}",
                f"127.0.0.1:{git_server.port}",
                f"127.0.0.1:{echo.port}",
                "127.0.0.1:5432",
                "172.17.0.1:5432",
                f"172.17.0.1:{vault_port}",
            ]
        )
        result = await stub.Execute(
            spb.ExecuteRequest(
                sandbox_id=sandbox_id,
                name="bash",
                input_json=json.dumps(
                    {
                        "command": f"python3 /workspace/hunt.py {needles} {not_before} {private} "
                        f"{targets} /workspace/private",
                        "timeout_seconds": 280,
                    }
                ),
            )
        )
        output = result.output
        print(output)  # shown on failure, and with -s
        assert "SCANNED" in output, output
        scanned = dict(kv.split("=") for kv in output.split("SCANNED ", 1)[1].split()[:3])
        assert int(scanned["files"]) > 100 and int(scanned["procs"]) > 0, output
        assert "REPO_OK" in output, output
        assert f"REMOTE origin\t{repo_url} (fetch)" in output, output
        for bad in ("FOUND", "READABLE", "REACHABLE", "GITERROR"):
            assert bad not in output, output

        # The very same secrets work through the vault, so isolation, not breakage, is why
        # the hunt came back empty.
        harness = vault.stub("harness")
        refs = await proxy(
            harness, session_token, "gh", f"{repo_url}/info/refs?service=git-upload-pack"
        )
        assert refs.status_code == 200 and b"refs/heads/main" in refs.body
        whoami = await proxy(harness, session_token, "api", f"{echo.base}/whoami")
        assert whoami.status_code == 200
        echoed = await proxy(harness, session_token, "api", f"{echo.base}/forms")
        assert MARKER.encode() in echoed.body and api_secret.encode() not in echoed.body
    finally:
        if sandbox_id:
            await stub.DestroySandbox(spb.DestroySandboxRequest(sandbox_id=sandbox_id))
        await channel.close()
        await sandbox_server.stop(0)
        await manager.close()
        await stop_vault(vault)
        await echo.stop()
        await git_server.stop()
