"""SandboxService checks: idempotent provisioning and execution, tool errors as results,
timeouts, UTF-8 output, workspace confinement, labels, destroy and file transfer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from oma.conformance.checks._util import expect_error, unique
from oma.conformance.registry import check
from oma.conformance.target import Target
from oma.sandbox.v1 import sandbox_pb2 as pb

LABEL = "conformance.oma.dev/run"


def _stub(target: Target) -> Any:
    return target.stub("sandbox", "harness")


async def _provision(target: Target, **labels: str) -> Any:
    request = pb.ProvisionRequest(request_id=unique("prov"), labels={LABEL: unique("r"), **labels})
    return (await _stub(target).Provision(request)).sandbox


async def _execute(target: Target, sandbox_id: str, name: str, tool_input: dict[str, Any],
                   **fields: Any) -> Any:
    return await _stub(target).Execute(pb.ExecuteRequest(
        sandbox_id=sandbox_id, name=name, input_json=json.dumps(tool_input), **fields))


async def _destroy(target: Target, sandbox_id: str) -> None:
    await _stub(target).DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox_id))


@check("sandbox", "SANDBOX-PROVISION-001", "SANDBOX-PROVISION-004", "SANDBOX-LIST-001")
async def check_provision_is_idempotent_and_keeps_labels(target: Target) -> None:
    run = unique("run")
    request = pb.ProvisionRequest(request_id=unique("prov"), labels={LABEL: run})
    first = (await _stub(target).Provision(request)).sandbox
    try:
        again = (await _stub(target).Provision(request)).sandbox
        assert again.id == first.id, "a repeated request_id provisioned a second sandbox"
        assert dict(first.labels).get(LABEL) == run
        listed = await _stub(target).ListSandboxes(pb.ListSandboxesRequest(
            label_selector={LABEL: run}))
        assert [s.id for s in listed.sandboxes] == [first.id]
    finally:
        await _destroy(target, first.id)


@check("sandbox", "SANDBOX-EXEC-001")
async def check_a_failing_command_is_a_result_not_an_rpc_error(target: Target) -> None:
    sandbox = await _provision(target)
    try:
        result = await _execute(target, sandbox.id, "bash", {"command": "echo oops >&2; exit 3"})
        assert result.is_error and result.exit_code == 3, result
        assert "oops" in result.output
        missing = await _execute(target, sandbox.id, "read", {"path": "no/such/file"})
        assert missing.is_error, missing
    finally:
        await _destroy(target, sandbox.id)


@check("sandbox", "SANDBOX-EXEC-002")
async def check_an_execution_id_runs_once(target: Target) -> None:
    sandbox = await _provision(target)
    try:
        execution_id = unique("exec")
        command = {"command": "echo run >> runs.txt; wc -l < runs.txt"}
        first = await _execute(target, sandbox.id, "bash", command, execution_id=execution_id)
        again = await _execute(target, sandbox.id, "bash", command, execution_id=execution_id)
        assert again.output == first.output
        count = await _execute(target, sandbox.id, "bash", {"command": "wc -l < runs.txt"})
        assert count.output.strip() == "1", f"the tool ran {count.output.strip()} times"
    finally:
        await _destroy(target, sandbox.id)


@check("sandbox", "SANDBOX-EXEC-003")
async def check_a_timeout_kills_the_call_and_says_so(target: Target) -> None:
    sandbox = await _provision(target)
    try:
        result = await _execute(target, sandbox.id, "bash", {"command": "echo started; sleep 60"},
                                timeout=Duration(nanos=500_000_000))
        assert result.timed_out and result.is_error, result
        assert "started" in result.output
    finally:
        await _destroy(target, sandbox.id)


@check("sandbox", "SANDBOX-EXEC-004")
async def check_invalid_utf8_is_replaced_and_flagged(target: Target) -> None:
    sandbox = await _provision(target)
    try:
        result = await _execute(target, sandbox.id, "bash", {"command": r"printf 'a\377b'"})
        assert result.invalid_utf8_replaced and result.output == "a\ufffdb", repr(result.output)
    finally:
        await _destroy(target, sandbox.id)


@check("sandbox", "SANDBOX-PATH-001")
async def check_paths_outside_the_workspace_are_refused(target: Target) -> None:
    sandbox = await _provision(target)
    try:
        await expect_error(_execute(target, sandbox.id, "read", {"path": "../../etc/passwd"}),
                           grpc.StatusCode.INVALID_ARGUMENT, "PATH_OUTSIDE_WORKSPACE")
        await expect_error(_execute(target, sandbox.id, "write", {"path": "/etc/x", "content": ""}),
                           grpc.StatusCode.INVALID_ARGUMENT, "PATH_OUTSIDE_WORKSPACE")
    finally:
        await _destroy(target, sandbox.id)


@check("sandbox", "SANDBOX-DESTROY-001", "SANDBOX-GET-001")
async def check_destroy_is_idempotent_and_final(target: Target) -> None:
    sandbox = await _provision(target)
    await _destroy(target, sandbox.id)
    await _destroy(target, sandbox.id)
    await _destroy(target, unique("never-existed"))
    got = (await _stub(target).GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox.id))).sandbox
    assert got.state == pb.SANDBOX_STATE_TERMINATED, got
    await expect_error(_execute(target, sandbox.id, "bash", {"command": "true"}),
                       grpc.StatusCode.FAILED_PRECONDITION, "SANDBOX_TERMINATED")
    await expect_error(_stub(target).GetSandbox(pb.GetSandboxRequest(sandbox_id=unique("no"))),
                       grpc.StatusCode.NOT_FOUND, "SANDBOX_NOT_FOUND")


@check("sandbox", "SANDBOX-FILE-001", "SANDBOX-FILE-003")
async def check_files_round_trip_byte_for_byte(target: Target) -> None:
    sandbox = await _provision(target)
    payload = bytes(range(256)) * 1000

    async def parts() -> AsyncIterator[pb.UploadFileRequest]:
        yield pb.UploadFileRequest(header=pb.UploadFileHeader(sandbox_id=sandbox.id,
                                                              path="data/blob.bin"))
        for start in range(0, len(payload), 64 * 1024):
            yield pb.UploadFileRequest(chunk=payload[start:start + 64 * 1024])

    try:
        uploaded = await _stub(target).UploadFile(parts())
        assert uploaded.size_bytes == len(payload)
        chunks = [part.chunk async for part in _stub(target).DownloadFile(
            pb.DownloadFileRequest(sandbox_id=sandbox.id, path="data/blob.bin"))]
        assert b"".join(chunks) == payload
    finally:
        await _destroy(target, sandbox.id)


@check("sandbox", "SANDBOX-STREAM-001", "SANDBOX-STREAM-002",
       requires_features=("sandbox.execute_stream",))
async def check_a_stream_reattaches_by_execution_id(target: Target) -> None:
    sandbox = await _provision(target)
    try:
        execution_id = unique("exec")
        request = pb.ExecuteStreamRequest(sandbox_id=sandbox.id, name="bash",
                                          input_json=json.dumps({"command": "echo one; echo two"}),
                                          execution_id=execution_id)
        first = [item async for item in _stub(target).ExecuteStream(request)]
        replay = [item async for item in _stub(target).ExecuteStream(
            pb.ExecuteStreamRequest(sandbox_id=sandbox.id, execution_id=execution_id))]
        for items in (first, replay):
            exits = [i for i in items if i.WhichOneof("event") == "exited"]
            assert len(exits) == 1 and items[-1].WhichOneof("event") == "exited"
            stdout = b"".join(i.stdout.data for i in items if i.WhichOneof("event") == "stdout")
            assert stdout == b"one\ntwo\n", stdout
        assert replay[0].started.reattached
    finally:
        await _destroy(target, sandbox.id)
