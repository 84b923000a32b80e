"""Hardening, verified from inside the sandbox, on both backends."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from google.protobuf import duration_pb2
from sandbox_helpers import SandboxServer

from oma.sandbox.v1 import sandbox_pb2 as pb
from oma.servers.sandbox.backends.base import SandboxDirectories
from oma.servers.sandbox.model import MiB
from oma.servers.sandbox.protocol import ExecutorClient, ExecutorUnreachable


async def test_no_network_no_capabilities_non_root_read_only_root(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    interfaces = await sandbox_server.bash(
        sandbox_id, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '"
    )
    assert interfaces.output.split() == ["lo"]
    caps = await sandbox_server.bash(
        sandbox_id, "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status"
    )
    assert caps.output.count("0000000000000000") == 5, caps.output
    user = await sandbox_server.bash(sandbox_id, "id -u; id -g")
    assert user.output.split()[0] != "0" and user.output.split()[1] != "0"
    for path in ("/probe", "/usr/probe", "/etc/probe", "/bin/probe"):
        write = await sandbox_server.bash(sandbox_id, f"touch {path}")
        assert write.is_error and "Read-only file system" in write.output, (path, write.output)
    workspace = await sandbox_server.bash(sandbox_id, "touch /workspace/ok /tmp/ok && echo yes")
    assert workspace.output == "yes\n"
    escalate = await sandbox_server.bash(sandbox_id, "grep NoNewPrivs /proc/self/status")
    if sandbox_server.backend == "docker":
        assert escalate.output.split() == ["NoNewPrivs:", "1"]
    outbound = await sandbox_server.bash(
        sandbox_id,
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"",
    )
    assert outbound.is_error and "unreachable" in outbound.output.lower()


async def test_server_data_and_keys_are_not_visible(
    sandbox_server: SandboxServer, sandbox_id: str, tmp_path: os.PathLike[str]
) -> None:
    secret = sandbox_server.root.parent / "tokens.json"
    secret.write_text('{"admin": "top-secret-token"}')
    probe = await sandbox_server.bash(
        sandbox_id,
        f"ls {sandbox_server.root} ; cat {secret} ; ls /root ; ls /home ; "
        "grep -rs -D skip --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev --exclude-dir=usr"
        " top-secret-token /"
        " | head -1; echo done",
        timeout=duration_pb2.Duration(seconds=60),
    )
    assert "top-secret-token" not in probe.output
    assert probe.output.endswith("done\n")
    assert f"cannot access '{sandbox_server.root}'" in probe.output
    if sandbox_server.backend == "local":
        listing = await sandbox_server.bash(sandbox_id, "ls / | tr '\\n' ' '")
        allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "oma", "proc", "sbin",
                   "tmp", "usr", "workspace"}  # fmt: skip
        assert set(listing.output.split()) <= allowed, listing.output
        etc = await sandbox_server.bash(sandbox_id, "ls /etc | tr '\\n' ' '")
        assert "shadow" not in etc.output.split() and "passwd" in etc.output.split()
        ssl = await sandbox_server.bash(sandbox_id, "ls /etc/ssl | tr '\\n' ' '")
        assert "private" not in ssl.output.split() and "certs" in ssl.output.split()


async def test_fork_bomb_hits_the_pids_limit_without_hurting_a_neighbour(
    sandbox_server: SandboxServer,
) -> None:
    bombed = await sandbox_server.provision(resources=pb.Resources(pids=64))
    neighbour = await sandbox_server.provision()
    counted = await sandbox_server.bash(
        bombed.id,
        'python3 -c "\nimport subprocess\nps = []\ntry:\n    for _ in range(500):\n'
        "        ps.append(subprocess.Popen(['sleep', '30']))\nexcept OSError as e:\n"
        "    print('refused after', len(ps), e.errno)\n\"",
        timeout=duration_pb2.Duration(seconds=60),
    )
    assert "refused after" in counted.output, counted.output
    assert int(counted.output.split()[2]) < 64
    bomb = asyncio.ensure_future(
        sandbox_server.bash(
            bombed.id,
            "bomb() { bomb | bomb & }; bomb; sleep 4",
            timeout=duration_pb2.Duration(seconds=8),
        )
    )
    # While the bomb runs, the neighbour and the server keep working.
    await asyncio.sleep(1)
    alive = await sandbox_server.bash(neighbour.id, "echo neighbour-ok")
    assert alive.output == "neighbour-ok\n"
    result = await bomb
    assert "Resource temporarily unavailable" in result.output
    after = await sandbox_server.bash(bombed.id, "echo survived")
    assert after.output == "survived\n"


async def test_memory_hog_is_killed_and_the_sandbox_survives(
    sandbox_server: SandboxServer,
) -> None:
    sandbox = await sandbox_server.provision(resources=pb.Resources(memory_bytes=128 * MiB))
    hog = await sandbox_server.bash(
        sandbox.id,
        'python3 -c "chunks = []\nwhile True: chunks.append(bytearray(16 * 1024 * 1024))"',
        timeout=duration_pb2.Duration(seconds=60),
    )
    assert hog.is_error
    assert hog.exit_code == 137 or "MemoryError" in hog.output, (hog.exit_code, hog.output)
    after = await sandbox_server.bash(sandbox.id, "echo still-here")
    assert after.output == "still-here\n"


async def test_the_ready_marker_is_out_of_the_sandboxs_reach(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    listing = await sandbox_server.bash(sandbox_id, "ls -A /oma/run")
    assert listing.output.split() == ["executor.sock"]
    assert sandbox_server.manager.backend.dirs.is_ready(sandbox_id)  # type: ignore[attr-defined]


def test_a_forged_or_planted_ready_marker_in_the_run_directory_is_ignored(
    tmp_path: Path,
) -> None:
    # The run directory is writable from inside the sandbox: a marker forged there must not
    # make a half-provisioned sandbox look ready, and a symbolic link planted there must not
    # make the server write through it on the host.
    dirs = SandboxDirectories(tmp_path / "root")
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    dirs.make("sb-forged", os.getuid(), os.getgid())
    (dirs.run("sb-forged") / "ready").write_text("forged")
    assert not dirs.is_ready("sb-forged")
    dirs.make("sb-planted", os.getuid(), os.getgid())
    (dirs.run("sb-planted") / "ready").symlink_to(victim)
    dirs.mark_ready("sb-planted")
    assert dirs.is_ready("sb-planted")
    assert victim.read_text() == "untouched"
    dirs.release()


async def test_a_socket_replaced_by_a_symlink_is_not_followed(tmp_path: Path) -> None:
    # Code in the sandbox can write the executor's socket directory: it must not be able to
    # point the server at some other socket of the host.
    connections: list[object] = []

    async def bait(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        writer.close()

    host_socket = tmp_path / "host.sock"
    server = await asyncio.start_unix_server(bait, path=str(host_socket))
    try:
        planted = tmp_path / "run" / "executor.sock"
        planted.parent.mkdir()
        planted.symlink_to(host_socket)
        with pytest.raises(ExecutorUnreachable):
            await ExecutorClient(planted).ping()
        assert connections == []
        # The host socket itself takes connections: only the link was refused.
        reader, writer = await asyncio.open_unix_connection(str(host_socket))
        await reader.read()  # the bait hangs up once it has counted the connection
        writer.close()
        assert len(connections) == 1
    finally:
        server.close()
