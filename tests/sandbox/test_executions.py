"""Idempotent executions, streaming and re-attaching, and file transfer, on both backends."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator

import grpc
from sandbox_helpers import SandboxServer, expect_error

from oma.sandbox.v1 import sandbox_pb2 as pb

COUNTING = "echo run >> runs.txt; wc -l < runs.txt"


async def test_same_execution_id_runs_once(sandbox_server: SandboxServer, sandbox_id: str) -> None:
    first = await sandbox_server.bash(sandbox_id, COUNTING, execution_id="toolu_01")
    second = await sandbox_server.bash(sandbox_id, COUNTING, execution_id="toolu_01")
    # A repeat ignores its (different) input and returns the recorded result.
    third = await sandbox_server.bash(sandbox_id, "echo other", execution_id="toolu_01")
    assert first.output == second.output == third.output == "1\n"
    assert first.execution_id == "toolu_01"
    other = await sandbox_server.bash(sandbox_id, COUNTING, execution_id="toolu_02")
    assert other.output == "2\n"
    # Concurrent duplicates while the first is still running: one run, one result.
    results = await asyncio.gather(
        *(
            sandbox_server.bash(sandbox_id, "sleep 0.5; " + COUNTING, execution_id="toolu_03")
            for _ in range(4)
        )
    )
    assert {r.output for r in results} == {"3\n"}
    count = await sandbox_server.bash(sandbox_id, "wc -l < runs.txt")
    assert count.output == "3\n"
    # Without an id the server assigns one.
    anonymous = await sandbox_server.bash(sandbox_id, "true")
    assert anonymous.execution_id.startswith("ex-")
    await expect_error(
        sandbox_server.bash(sandbox_id, "true", execution_id="bad id!"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )


async def collect(
    stream: AsyncIterator[pb.ExecuteStreamResponse],
) -> list[pb.ExecuteStreamResponse]:
    return [event async for event in stream]


def combined_output(events: list[pb.ExecuteStreamResponse]) -> bytes:
    chunks = [
        e.stdout if e.WhichOneof("event") == "stdout" else e.stderr
        for e in events
        if e.WhichOneof("event") in ("stdout", "stderr")
    ]
    data = b""
    for chunk in chunks:
        assert chunk.offset == len(data)  # no gap, no duplicate
        data += chunk.data
    return data


async def test_execute_stream_and_reattach(sandbox_server: SandboxServer, sandbox_id: str) -> None:
    command = "for i in 1 2 3 4; do echo out$i; echo err$i >&2; sleep 0.3; done; exit 3"
    first = sandbox_server.stub.ExecuteStream(
        pb.ExecuteStreamRequest(
            sandbox_id=sandbox_id,
            name="bash",
            input_json=f'{{"command": "{command}"}}',
            execution_id="toolu_stream",
        )
    )
    seen: list[pb.ExecuteStreamResponse] = []
    async for event in first:
        seen.append(event)
        if event.WhichOneof("event") == "stdout":
            break  # it is running: now a second client re-attaches
    assert seen[0].WhichOneof("event") == "started" and not seen[0].started.reattached
    second = await collect(
        sandbox_server.stub.ExecuteStream(
            pb.ExecuteStreamRequest(sandbox_id=sandbox_id, execution_id="toolu_stream")
        )
    )
    seen += [event async for event in first]
    assert second[0].started.reattached and second[0].started.name == "bash"
    for events in (seen, second):
        assert events[-1].WhichOneof("event") == "exited"
        assert [e.WhichOneof("event") for e in events].count("exited") == 1
        assert all(e.execution_id == "toolu_stream" for e in events)
        data = combined_output(events)
        assert sorted(data.decode().split()) == sorted(
            [f"out{i}" for i in range(1, 5)] + [f"err{i}" for i in range(1, 5)]
        )
        assert events[-1].exited.exit_code == 3 and events[-1].exited.is_error
    # The same id through Execute gives the same result, without a new run.
    unary = await sandbox_server.bash(sandbox_id, "echo never", execution_id="toolu_stream")
    assert unary == seen[-1].exited
    # After the end, a re-attach replays everything and the exit.
    replay = await collect(
        sandbox_server.stub.ExecuteStream(
            pb.ExecuteStreamRequest(sandbox_id=sandbox_id, execution_id="toolu_stream")
        )
    )
    assert combined_output(replay) == combined_output(seen)
    await expect_error(
        collect(
            sandbox_server.stub.ExecuteStream(
                pb.ExecuteStreamRequest(sandbox_id=sandbox_id, execution_id="never-started")
            )
        ),
        grpc.StatusCode.NOT_FOUND,
        "EXECUTION_NOT_FOUND",
    )


async def upload(
    server: SandboxServer, sandbox_id: str, path: str, data: bytes, chunk: int = 256 * 1024
) -> pb.UploadFileResponse:
    async def messages() -> AsyncIterator[pb.UploadFileRequest]:
        yield pb.UploadFileRequest(header=pb.UploadFileHeader(sandbox_id=sandbox_id, path=path))
        for start in range(0, len(data), chunk):
            yield pb.UploadFileRequest(chunk=data[start : start + chunk])

    return await server.stub.UploadFile(messages())


async def download(server: SandboxServer, sandbox_id: str, path: str) -> tuple[int, bytes]:
    size, data = -1, b""
    async for message in server.stub.DownloadFile(
        pb.DownloadFileRequest(sandbox_id=sandbox_id, path=path)
    ):
        size = message.size_bytes
        data += message.chunk
    return size, data


async def test_upload_and_download_are_binary_safe(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    payload = os.urandom(700 * 1024) + bytes(range(256)) * 4
    written = await upload(sandbox_server, sandbox_id, "bin/blob.dat", payload)
    assert written.size_bytes == len(payload)
    assert written.sha256 == hashlib.sha256(payload).hexdigest()
    assert written.path == "/workspace/bin/blob.dat"
    inside = await sandbox_server.bash(sandbox_id, "sha256sum bin/blob.dat")
    assert inside.output.split()[0] == written.sha256
    size, data = await download(sandbox_server, sandbox_id, "/workspace/bin/blob.dat")
    assert size == len(payload) and data == payload
    empty = await upload(sandbox_server, sandbox_id, "empty", b"")
    assert empty.size_bytes == 0
    assert await download(sandbox_server, sandbox_id, "empty") == (0, b"")


async def test_file_transfer_errors(sandbox_server: SandboxServer, sandbox_id: str) -> None:
    limit = sandbox_server.manager.limits.max_file_bytes
    error = await expect_error(
        upload(sandbox_server, sandbox_id, "big.bin", b"x" * (limit + 1)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "FILE_TOO_LARGE",
    )
    assert str(limit) in (error.details() or "")
    # Nothing half-written is left behind (the executor drops its temporary file as soon as
    # it sees the aborted transfer).
    listing = await sandbox_server.bash(
        sandbox_id,
        "for i in $(seq 50); do ls -A | grep -q oma-upload || break; sleep 0.1; done; ls -A",
    )
    assert "big.bin" not in listing.output and ".oma-upload" not in listing.output
    await sandbox_server.bash(sandbox_id, f"head -c {limit + 1} /dev/zero > big.bin")
    await expect_error(
        download(sandbox_server, sandbox_id, "big.bin"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "FILE_TOO_LARGE",
    )
    await expect_error(
        download(sandbox_server, sandbox_id, "missing.txt"),
        grpc.StatusCode.NOT_FOUND,
        "FILE_NOT_FOUND",
    )
    await expect_error(
        download(sandbox_server, sandbox_id, "/etc/passwd"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PATH_OUTSIDE_WORKSPACE",
    )
    await expect_error(
        upload(sandbox_server, sandbox_id, "../escape.txt", b"x"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PATH_OUTSIDE_WORKSPACE",
    )

    async def chunk_first() -> AsyncIterator[pb.UploadFileRequest]:
        yield pb.UploadFileRequest(chunk=b"no header")

    await expect_error(
        sandbox_server.stub.UploadFile(chunk_first()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_FIELD",
    )


async def test_reattach_after_the_end_replays_within_the_buffer(
    sandbox_server: SandboxServer, sandbox_id: str
) -> None:
    replay_limit = sandbox_server.manager.limits.stream_replay_bytes
    for size in (100_000, replay_limit + replay_limit // 2):
        execution_id = f"toolu_big_{size}"
        first = await collect(
            sandbox_server.stub.ExecuteStream(
                pb.ExecuteStreamRequest(
                    sandbox_id=sandbox_id,
                    name="bash",
                    input_json=f'{{"command": "head -c {size} /dev/urandom | base64 -w 100"}}',
                    execution_id=execution_id,
                )
            )
        )
        live = combined_output(first)
        assert len(live) == first[-1].exited.full_output_bytes > size
        again = await collect(
            sandbox_server.stub.ExecuteStream(
                pb.ExecuteStreamRequest(sandbox_id=sandbox_id, execution_id=execution_id)
            )
        )
        replayed = combined_output(again)
        assert again[-1].exited == first[-1].exited
        if len(live) <= replay_limit:
            assert replayed == live
        else:  # at least the stated buffer, from the start
            assert replay_limit - 64 * 1024 <= len(replayed) <= replay_limit
            assert live.startswith(replayed)
