"""Provision, list, destroy, death from outside, timeouts and restarts, on both backends."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from sandbox_helpers import SandboxServer, backend_fixtures, expect_error, run, start, stop

from oma.runtime.client import connect
from oma.sandbox.v1 import sandbox_pb2 as pb
from oma.sandbox.v1 import sandbox_pb2_grpc

SESSION = "oma.dev/session-id"


async def test_capabilities(sandbox_server: SandboxServer) -> None:
    # Clients may read capabilities, but not provision.
    async with connect(
        sandbox_server.running.address, token=sandbox_server.tokens.token_for("client")
    ) as channel:
        stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
        caps = await stub.GetCapabilities(pb.GetCapabilitiesRequest())
        await expect_error(
            stub.Provision(pb.ProvisionRequest()), grpc.StatusCode.PERMISSION_DENIED,
            "ROLE_FORBIDDEN",
        )  # fmt: skip
    assert caps.backend == sandbox_server.backend
    assert [t.name for t in caps.tools] == ["bash", "read", "write", "edit", "glob", "grep"]
    for tool in caps.tools:
        assert json.loads(tool.input_schema_json)["type"] == "object"
    assert caps.server_info.limits["sandbox.max_output_bytes"] > 0
    assert (
        caps.server_info.limits["sandbox.max_file_bytes"]
        == sandbox_server.manager.limits.max_file_bytes
    )
    assert "oma.sandbox.v1" in caps.server_info.api_versions
    assert "sandbox.execute_stream" in caps.server_info.features
    assert "sandbox.network_allow_list" not in caps.server_info.features
    restart = "sandbox.survives_server_restart" in caps.server_info.features
    assert restart == (sandbox_server.backend == "docker")
    assert caps.default_resources.memory_bytes > 0 and caps.default_resources.idle_timeout.seconds


async def test_provision_is_idempotent_and_labelled(sandbox_server: SandboxServer) -> None:
    request = {
        "request_id": "req-1",
        "labels": {SESSION: "sess-a", "team": "blue"},
        "init": pb.InitSteps(
            files=[
                pb.InitFile(path="bin/run.sh", content=b"#!/bin/sh\necho ran\n", mode=0o755),
                pb.InitFile(path="/workspace/data.bin", content=bytes(range(256))),
            ]
        ),
    }
    first = await sandbox_server.provision(**request)
    again = await sandbox_server.provision(**request)
    assert first.id == again.id and first.state == pb.SANDBOX_STATE_READY
    assert dict(first.labels) == {SESSION: "sess-a", "team": "blue"}
    assert first.backend == sandbox_server.backend
    await expect_error(
        sandbox_server.provision(request_id="req-1", labels={SESSION: "other"}),
        grpc.StatusCode.ALREADY_EXISTS,
        "REQUEST_ID_REUSED",
    )
    ran = await sandbox_server.bash(first.id, "./bin/run.sh && stat -c %a bin/run.sh && "
                                    "od -An -tx1 data.bin | tr -d ' \\n' | head -c 16")  # fmt: skip
    assert ran.output == "ran\n755\n0001020304050607"

    # Concurrent retries of one request id make one sandbox.
    results = await asyncio.gather(
        *(
            sandbox_server.provision(request_id="req-2", labels={SESSION: "sess-b"})
            for _ in range(3)
        )
    )
    assert len({s.id for s in results}) == 1
    listed = await sandbox_server.stub.ListSandboxes(
        pb.ListSandboxesRequest(label_selector={SESSION: "sess-b"})
    )
    assert [s.id for s in listed.sandboxes] == [results[0].id]


async def test_list_filters_by_labels_and_pages(sandbox_server: SandboxServer) -> None:
    ids = [
        (await sandbox_server.provision(labels={SESSION: "paged", "n": str(i)})).id
        for i in range(3)
    ]
    await sandbox_server.provision(labels={SESSION: "elsewhere"})
    first = await sandbox_server.stub.ListSandboxes(
        pb.ListSandboxesRequest(label_selector={SESSION: "paged"}, page_size=2)
    )
    assert len(first.sandboxes) == 2 and first.next_page_token
    second = await sandbox_server.stub.ListSandboxes(
        pb.ListSandboxesRequest(
            label_selector={SESSION: "paged"}, page_size=2, page_token=first.next_page_token
        )
    )
    assert not second.next_page_token
    assert [s.id for s in [*first.sandboxes, *second.sandboxes]] == ids
    one = await sandbox_server.stub.ListSandboxes(
        pb.ListSandboxesRequest(label_selector={SESSION: "paged", "n": "1"})
    )
    assert [s.id for s in one.sandboxes] == [ids[1]]
    await expect_error(
        sandbox_server.stub.ListSandboxes(pb.ListSandboxesRequest(page_token="garbage")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )


async def test_destroy_is_idempotent_and_final(sandbox_server: SandboxServer) -> None:
    sandbox = await sandbox_server.provision(labels={SESSION: "gone"})
    destroyed = await sandbox_server.stub.DestroySandbox(
        pb.DestroySandboxRequest(sandbox_id=sandbox.id)
    )
    assert destroyed.sandbox.state == pb.SANDBOX_STATE_TERMINATED
    assert "DestroySandbox" in destroyed.sandbox.terminate_reason
    again = await sandbox_server.stub.DestroySandbox(
        pb.DestroySandboxRequest(sandbox_id=sandbox.id)
    )
    assert again.sandbox.id == sandbox.id
    unknown = await sandbox_server.stub.DestroySandbox(
        pb.DestroySandboxRequest(sandbox_id="sb-ffffffffffffffffffffffff")
    )
    assert not unknown.HasField("sandbox")
    await expect_error(
        sandbox_server.bash(sandbox.id, "true"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SANDBOX_TERMINATED",
    )
    listed = await sandbox_server.stub.ListSandboxes(
        pb.ListSandboxesRequest(label_selector={SESSION: "gone"})
    )
    assert not listed.sandboxes
    with_dead = await sandbox_server.stub.ListSandboxes(
        pb.ListSandboxesRequest(label_selector={SESSION: "gone"}, include_terminated=True)
    )
    assert [s.id for s in with_dead.sandboxes] == [sandbox.id]
    assert list(sandbox_server.root.glob(f"**/{sandbox.id}")) == []


async def test_killed_from_outside_is_terminated(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    if sandbox_server.backend == "docker":
        await run("docker", "kill", f"oma-{sandbox_id}")
    else:
        process = sandbox_server.manager.backend.processes[sandbox_id]  # type: ignore[attr-defined]
        os.kill(process.pid, signal.SIGKILL)
        await process.wait()
    await expect_error(
        sandbox_server.bash(sandbox_id, "true"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SANDBOX_TERMINATED",
    )
    got = await sandbox_server.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox_id))
    assert got.sandbox.state == pb.SANDBOX_STATE_TERMINATED
    assert got.sandbox.terminate_reason and got.sandbox.HasField("terminate_time")


async def test_bad_provision_requests(sandbox_server: SandboxServer) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    await expect_error(
        sandbox_server.provision(image="no-such-image:never"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "IMAGE_NOT_FOUND",
    )
    await expect_error(
        sandbox_server.provision(resources=pb.Resources(memory_bytes=1 << 50)),
        invalid,
        "RESOURCES_EXCEED_LIMIT",
    )
    await expect_error(
        sandbox_server.provision(labels={"oma.dev/sandbox-id": "mine"}), invalid, "INVALID_FIELD"
    )
    await expect_error(
        sandbox_server.provision(
            resources=pb.Resources(cpu_millis=(os.cpu_count() or 1) * 1000 + 1)
        ),
        invalid,
        "RESOURCES_EXCEED_LIMIT",
    )
    await expect_error(
        sandbox_server.provision(
            init=pb.InitSteps(files=[pb.InitFile(path="../outside", content=b"x")])
        ),
        invalid,
        "PATH_OUTSIDE_WORKSPACE",
    )
    await expect_error(
        sandbox_server.provision(
            network=pb.NetworkPolicy(mode=pb.NETWORK_MODE_ALLOW_LIST, allowed_hosts=["pypi.org"])
        ),
        grpc.StatusCode.UNIMPLEMENTED,
        "FEATURE_NOT_SUPPORTED",
    )
    await expect_error(
        sandbox_server.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id="sb-nothing")),
        grpc.StatusCode.NOT_FOUND,
        "SANDBOX_NOT_FOUND",
    )
    # Failed provisions leave nothing behind.
    listed = await sandbox_server.stub.ListSandboxes(pb.ListSandboxesRequest())
    assert not listed.sandboxes
    assert list(sandbox_server.root.glob("**/sb-*")) == []


@pytest.fixture
def git_daemon(tmp_path: Path) -> Iterator[str]:
    """A real `git daemon` on 127.0.0.1 serving one repository with a tag; yields its URL."""
    base = tmp_path / "git"
    work = base / "src"
    work.mkdir(parents=True)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@x"}  # fmt: skip

    def git(*args: str, cwd: Path = work) -> None:
        subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)

    git("init", "-q", "-b", "main")
    (work / "README.md").write_text("version one\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    git("tag", "v1")
    (work / "README.md").write_text("version two\n")
    git("commit", "-q", "-am", "two")
    git("clone", "-q", "--bare", str(work), str(base / "project.git"), cwd=base)
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = subprocess.Popen(
        ["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={base}",
         "--listen=127.0.0.1", f"--port={port}", str(base)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as attempt:
            if attempt.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    try:
        yield f"git://127.0.0.1:{port}/project.git"
    finally:
        daemon.terminate()
        daemon.wait(10)


async def test_git_clone_init_steps(sandbox_server: SandboxServer, git_daemon: str) -> None:
    sandbox = await sandbox_server.provision(
        init=pb.InitSteps(
            repositories=[
                pb.GitRepository(url=git_daemon),
                pb.GitRepository(url=git_daemon, ref="v1", path="old/project"),
            ],
            files=[pb.InitFile(path="project/EXTRA.txt", content=b"added after the clone")],
        )
    )
    shown = await sandbox_server.bash(
        sandbox.id,
        "cat project/README.md old/project/README.md project/EXTRA.txt; echo; "
        "git -C project log --oneline | wc -l; stat -c %u project/README.md; id -u",
    )
    lines = shown.output.splitlines()
    assert lines[:3] == ["version two", "version one", "added after the clone"]
    assert lines[3] == "2"
    assert lines[4] == lines[5]  # the tree belongs to the sandbox user


async def test_an_abandoned_clone_kills_git(tmp_path: Path) -> None:
    from oma.servers.sandbox import git

    # A server that accepts git's request and never answers: git would wait for ever.
    connected = asyncio.Event()
    hung_up = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await reader.read()  # until git's end of the connection closes
        hung_up.set()
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    task = asyncio.create_task(git.clone(f"http://127.0.0.1:{port}/hung.git", "", tmp_path / "c"))
    try:
        await asyncio.wait_for(connected.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Only a killed git (and git-remote-http) closes the connection.
        await asyncio.wait_for(hung_up.wait(), 60)
    finally:
        server.close()


async def test_credentialed_repository_without_vault_fails_cleanly(
    sandbox_server: SandboxServer, git_daemon: str
) -> None:
    error = await expect_error(
        sandbox_server.provision(
            request_id="with-cred",
            labels={SESSION: "cred"},
            init=pb.InitSteps(
                repositories=[pb.GitRepository(url=git_daemon, credential_id="cred-github")]
            ),
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "INIT_FAILED",
    )
    assert "vault" in (error.details() or "")
    await expect_error(
        sandbox_server.provision(
            init=pb.InitSteps(repositories=[pb.GitRepository(url=git_daemon + "-missing")])
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "INIT_FAILED",
    )
    listed = await sandbox_server.stub.ListSandboxes(pb.ListSandboxesRequest())
    assert not listed.sandboxes
    assert list(sandbox_server.root.glob("**/sb-*")) == []


@pytest.mark.parametrize("backend", ["docker", "local"])
async def test_lifetime_and_idle_timeouts_destroy(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    backend_fixtures(request, backend)
    server = await start(backend, tmp_path / "sandboxes", reaper_interval=0.1)
    try:
        short_life = await server.provision(
            resources=pb.Resources(lifetime=duration_pb2.Duration(seconds=1))
        )
        idle = await server.provision(
            resources=pb.Resources(idle_timeout=duration_pb2.Duration(seconds=1))
        )
        kept = await server.provision()
        busy = await server.provision(
            resources=pb.Resources(idle_timeout=duration_pb2.Duration(seconds=1))
        )
        # A tool call longer than the idle timeout keeps its sandbox alive.
        long_call = await server.bash(busy.id, "sleep 2.5; echo finished")
        assert long_call.output == "finished\n" and not long_call.is_error
        reasons: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while len(reasons) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            for sandbox in (short_life, idle):
                record = server.manager.records[sandbox.id]
                if record.terminate_reason:
                    reasons[sandbox.id] = record.terminate_reason
        assert "lifetime" in reasons[short_life.id]
        assert "idle" in reasons[idle.id]
        await expect_error(
            server.bash(idle.id, "true"), grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_TERMINATED"
        )
        alive = await server.bash(kept.id, "echo kept")
        assert alive.output == "kept\n"
    finally:
        await stop(server)


async def test_docker_sandboxes_survive_a_server_restart(
    docker_client: object, tmp_path: Path
) -> None:
    root = tmp_path / "sandboxes"
    first = await start("docker", root)
    orphan_id = ""
    try:
        sandbox = await first.provision(request_id="keep-me", labels={SESSION: "restart"})
        await first.bash(sandbox.id, "echo before > kept.txt")
        ran = await first.bash(
            sandbox.id, "echo run >> runs.txt; wc -l < runs.txt", execution_id="toolu_restart_1"
        )
        orphan = await first.provision(labels={SESSION: "orphan"})
        orphan_id = orphan.id
    finally:
        await stop(first, destroy=False)
    # A container that died while the server was down is an orphan: reaped at start.
    await run("docker", "kill", f"oma-{orphan_id}")

    second = await start("docker", root)
    try:
        found = await second.stub.ListSandboxes(
            pb.ListSandboxesRequest(label_selector={SESSION: "restart"})
        )
        assert [s.id for s in found.sandboxes] == [sandbox.id]
        assert found.sandboxes[0].state == pb.SANDBOX_STATE_READY
        again = await second.provision(request_id="keep-me", labels={SESSION: "restart"})
        assert again.id == sandbox.id
        kept = await second.bash(sandbox.id, "cat kept.txt")
        assert kept.output == "before\n"
        repeat = await second.bash(
            sandbox.id, "echo run >> runs.txt; wc -l < runs.txt", execution_id="toolu_restart_1"
        )
        assert repeat.output == ran.output == "1\n"
        await expect_error(
            second.stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=orphan_id)),
            grpc.StatusCode.NOT_FOUND,
            "SANDBOX_NOT_FOUND",
        )
        gone = await run("docker", "ps", "-aq", "--filter", f"name=oma-{orphan_id}")
        assert gone.strip() == ""
    finally:
        await stop(second)


def test_one_docker_server_per_root(docker_client: object, tmp_path: Path) -> None:
    from oma.servers.sandbox.server import build_manager

    first = build_manager("docker", tmp_path / "sandboxes")
    with pytest.raises(RuntimeError, match="another sandbox server"):
        build_manager("docker", tmp_path / "sandboxes")
    first.backend.dirs.release()  # type: ignore[attr-defined]
    build_manager("docker", tmp_path / "sandboxes").backend.dirs.release()  # type: ignore[attr-defined]


async def test_local_servers_share_a_root_and_reap_dead_ones(
    bwrap_path: str, tmp_path: Path
) -> None:
    root = tmp_path / "sandboxes"
    first = await start("local", root)
    second = await start("local", root)
    try:
        a = await first.provision()
        b = await second.provision()
        assert (await first.bash(a.id, "echo a")).output == "a\n"
        assert (await second.bash(b.id, "echo b")).output == "b\n"
        # A server that died without cleaning up: its lock is free, its directory remains.
        backend = first.manager.backend
        backend.dirs.release()  # type: ignore[attr-defined]
        third = await start("local", root)
        await stop(third)
        assert not backend.instance.exists()  # type: ignore[attr-defined]
        assert (await second.bash(b.id, "echo still")).output == "still\n"
    finally:
        await stop(second)
        await stop(first)
