"""CloneRepository against a real git server (`git http-backend` behind basic auth): the
checkout arrives as a tar with no trace of the token."""

from __future__ import annotations

import asyncio
import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import grpc
import pytest
from vault_calls import create, expect_error, hosts, issue
from vault_upstreams import LoopbackServer, git_server_app, make_bare_repository

from oma.servers.vault import gitclone
from oma.servers.vault.models import CredentialKind, Secret
from oma.servers.vault.scrub import Scrubber
from oma.vault.v1 import vault_pb2 as pb

GIT_TOKEN = "ghp_" + "S3cretGitToken" * 2


@pytest.fixture
async def git_server(tmp_path: Path):
    root = tmp_path / "git-root"
    make_bare_repository(root, "private", {"README.md": "# private\n", "src/app.py": "print(1)\n"})
    server = await LoopbackServer(git_server_app(root, "x-access-token", GIT_TOKEN)).start()
    try:
        yield server
    finally:
        await server.stop()


async def clone(stub, token: str, credential_id: str, url: str, **kw) -> tuple[pb.CloneInfo, bytes]:
    info = None
    data = bytearray()
    async for message in stub.CloneRepository(
        pb.CloneRepositoryRequest(session_token=token, credential_id=credential_id, url=url, **kw)
    ):
        if message.HasField("info"):
            assert info is None and not data
            info = message.info
        else:
            data += message.tar_chunk
    assert info is not None
    return info, bytes(data)


def _git_head(repo: Path, home: Path) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
    )
    return result.stdout.strip()


def files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def test_clone_leaves_no_trace_of_the_token(vault, git_server, tmp_path: Path) -> None:
    url = f"{git_server.base}/private.git"
    # Without the vault the repository is private.
    # (async: the git server runs in this event loop)
    denied = await asyncio.create_subprocess_exec(
        "git",
        "clone",
        "-q",
        url,
        str(tmp_path / "anon"),
        env={"GIT_TERMINAL_PROMPT": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert await denied.wait() != 0
    await create(
        vault.stub(),
        pb.CredentialSecret(git_token=pb.GitTokenSecret(token=GIT_TOKEN)),
        hosts(("127.0.0.1", git_server.port)),
        credential_id="gh",
    )
    token = await issue(vault.stub(), "ses_g", "gh")
    info, archive = await clone(vault.stub("sandbox_server"), token, "gh", url)
    assert len(info.commit) == 40 and info.ref == "main"
    dest = tmp_path / "checkout"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    assert (dest / "README.md").read_text() == "# private\n"
    assert (dest / "src" / "app.py").exists()
    assert files_containing(dest, GIT_TOKEN.encode()) == []
    config = (dest / ".git" / "config").read_text()
    assert f"url = {url}" in config and "extraheader" not in config.lower()
    assert "helper" not in config
    assert _git_head(dest, tmp_path) == info.commit
    audit = await vault.stub().ListAudit(pb.ListAuditRequest(session_id="ses_g"))
    assert (audit.records[0].action, audit.records[0].outcome) == ("clone", "OK")


async def test_clone_errors(vault, git_server) -> None:
    url = f"{git_server.base}/private.git"
    stub = vault.stub()
    await create(
        stub,
        pb.CredentialSecret(git_token=pb.GitTokenSecret(token="wrong-" + GIT_TOKEN)),
        hosts(("127.0.0.1", git_server.port)),
        credential_id="bad",
    )
    await create(
        stub,
        pb.CredentialSecret(git_token=pb.GitTokenSecret(token=GIT_TOKEN)),
        hosts(("git.example.com", 0)),
        credential_id="elsewhere",
    )
    token = await issue(stub, "ses_g", "bad", "elsewhere")
    sandbox = vault.stub("sandbox_server")
    exc = await expect_error(
        clone(sandbox, token, "bad", url), grpc.StatusCode.FAILED_PRECONDITION, "CLONE_FAILED"
    )
    assert GIT_TOKEN not in exc.details()
    await expect_error(
        clone(sandbox, token, "elsewhere", url),
        grpc.StatusCode.PERMISSION_DENIED,
        "HOST_NOT_ALLOWED",
    )
    await expect_error(
        clone(sandbox, "omavst_nope", "bad", url),
        grpc.StatusCode.UNAUTHENTICATED,
        "SESSION_TOKEN_INVALID",
    )
    await expect_error(
        clone(vault.stub("harness"), token, "bad", url),
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_FORBIDDEN",
    )


async def test_a_cancelled_clone_kills_git() -> None:
    # An upstream that accepts git's request and never answers: git waits for ever.
    connected = asyncio.Event()
    hung_up = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await reader.read()  # until git's end of the connection closes
        hung_up.set()
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    secret = Secret(CredentialKind.GIT_TOKEN, token=GIT_TOKEN)
    task = asyncio.create_task(
        gitclone.clone(
            f"http://127.0.0.1:{port}/hung.git",
            "",
            0,
            secret,
            Scrubber([GIT_TOKEN]),
            time_limit=3600,
            max_bytes=1 << 20,
        )
    )
    try:
        await asyncio.wait_for(connected.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Only a killed git closes its connection; a live one would wait for an answer.
        await asyncio.wait_for(hung_up.wait(), 60)
    finally:
        server.close()


def test_the_leak_check_finds_the_token_base64_encoded(tmp_path: Path) -> None:
    import base64

    scrubber = Scrubber([GIT_TOKEN])
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n\tbare = false\n")
    assert gitclone.find_secret(tmp_path, scrubber) is None
    header = base64.b64encode(f"x-access-token:{GIT_TOKEN}".encode()).decode()
    (tmp_path / ".git" / "config").write_text(f'[http]\n\textraHeader = "Basic {header}"\n')
    assert gitclone.find_secret(tmp_path, scrubber) == tmp_path / ".git" / "config"


def test_git_is_installed() -> None:
    assert shutil.which("git")
