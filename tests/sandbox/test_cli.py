"""`oma serve sandbox` and `oma sandbox build-image` as a user runs them."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from sandbox_helpers import run

from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.sandbox.v1 import sandbox_pb2 as pb
from oma.sandbox.v1 import sandbox_pb2_grpc


async def test_serve_sandbox_local_until_sigterm(bwrap_path: str, tmp_path: Path) -> None:
    tokens = TokenTable.generate()
    tokens_file = tmp_path / "tokens.json"
    tokens.save(tokens_file)
    root = tmp_path / "sandboxes"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "oma.cli.main", "serve", "sandbox", "--backend", "local",
        "--listen", "127.0.0.1:0", "--tokens", str(tokens_file), "--root", str(root),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert process.stdout is not None
    address = ""
    try:
        while not address:
            line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode()
            assert line, "the server exited before announcing its address"
            if "serving on" in line:
                address = line.split()[-1]
        async with connect(address, token=tokens.token_for("harness")) as channel:
            stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
            caps = await stub.GetCapabilities(pb.GetCapabilitiesRequest())
            assert caps.backend == "local"
            sandbox = (await stub.Provision(pb.ProvisionRequest())).sandbox
            result = await stub.Execute(
                pb.ExecuteRequest(
                    sandbox_id=sandbox.id,
                    name="bash",
                    input_json=json.dumps({"command": "echo hi"}),
                )
            )
            assert result.output == "hi\n"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 60) == 0
        # Local sandboxes die with their server, and leave nothing behind.
        assert list(root.glob("**/sb-*")) == [] and list(root.glob("i-*")) == []
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_build_image_is_a_no_op_when_the_image_exists(docker_client: object) -> None:
    output = await run(sys.executable, "-m", "oma.cli.main", "sandbox", "build-image")
    assert "already exists" in output
