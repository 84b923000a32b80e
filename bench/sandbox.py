"""`oma bench sandbox`: what the sandbox service costs against raw Docker.

Prints details, then as its last line exactly

    exec_ratio=X provision_ratio=Y provision_local_p50_ms=Z

all measured in one run, each server (`oma serve sandbox`) in its own process:

- exec_ratio: p50 latency of `Execute(bash, {"command": "true"})` through gRPC on a warm Docker
  sandbox, divided by the p50 of a raw exec of `true` in the same container through the Docker
  SDK from this process (`exec_create` + `exec_start`). Target <= 0.05.
- provision_ratio: p50 of `Provision` (returning once the sandbox executes tools) divided by
  the p50 of a raw `containers.run` of the same image through the SDK (run `true`, wait for
  it). Target <= 1.5.
- provision_local_p50_ms: p50 of `Provision` on the bubblewrap backend, in milliseconds.

`--quick` uses fewer samples and finishes in well under a minute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer samples, under a minute")
    parser.add_argument(
        "--image", default="oma-sandbox:latest", help="sandbox image (default oma-sandbox:latest)"
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_main(args))


def _p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


class _Server:
    """`oma serve sandbox` in a child process."""

    def __init__(self, backend: str, root: Any, tokens: Any, image: str) -> None:
        self.backend = backend
        self.root = root
        self.tokens = tokens
        self.image = image
        self.process: Any = None
        self.address = ""

    async def __aenter__(self) -> _Server:
        import asyncio
        import sys

        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "oma.cli.main", "serve", "sandbox",
            "--backend", self.backend, "--listen", "127.0.0.1:0",
            "--tokens", str(self.tokens), "--root", str(self.root), "--image", self.image,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        assert self.process.stdout is not None
        while True:
            line = await asyncio.wait_for(self.process.stdout.readline(), 60)
            if not line:
                raise SystemExit(f"oma serve sandbox --backend {self.backend} did not start")
            text = line.decode().strip()
            if " serving on " in text:
                self.address = text.rsplit(" ", 1)[-1]
                return self

    async def __aexit__(self, *exc: object) -> None:
        import asyncio
        import signal

        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 30)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


async def _main(args: argparse.Namespace) -> int:
    import asyncio
    import tempfile
    from pathlib import Path

    import docker

    from oma.runtime.auth import TokenTable
    from oma.runtime.client import connect
    from oma.sandbox.v1 import sandbox_pb2 as pb
    from oma.sandbox.v1 import sandbox_pb2_grpc

    exec_samples, raw_exec_samples = (100, 20) if args.quick else (500, 60)
    provision_samples = 5 if args.quick else 15
    client = docker.from_env(timeout=120)
    client.images.get(args.image)  # fails early (and clearly) when the image is missing

    with tempfile.TemporaryDirectory(prefix="oma-bench-sandbox-") as tmp:
        tokens = TokenTable.generate()
        tokens_file = Path(tmp) / "tokens.json"
        tokens.save(tokens_file)
        token = tokens.token_for("harness")

        async with _Server("docker", Path(tmp) / "docker", tokens_file, args.image) as server:
            async with connect(server.address, token=token) as channel:
                stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
                provision_times = []
                for _ in range(provision_samples + 1):
                    started = time.perf_counter()
                    sandbox = (await stub.Provision(pb.ProvisionRequest())).sandbox
                    provision_times.append(time.perf_counter() - started)
                    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox.id))
                provision_times = provision_times[1:]  # the first warms the engine's caches

                sandbox = (await stub.Provision(pb.ProvisionRequest())).sandbox
                request = pb.ExecuteRequest(
                    sandbox_id=sandbox.id, name="bash", input_json='{"command": "true"}'
                )
                for _ in range(20):
                    await stub.Execute(request)
                exec_times = []
                for _ in range(exec_samples):
                    started = time.perf_counter()
                    result = await stub.Execute(request)
                    exec_times.append(time.perf_counter() - started)
                    assert not result.is_error, result.output

                container = client.containers.get(f"oma-{sandbox.id}")

                def raw_exec() -> float:
                    started = time.perf_counter()
                    exec_id = client.api.exec_create(container.id, ["true"])["Id"]
                    client.api.exec_start(exec_id)
                    return time.perf_counter() - started

                raw_exec()
                raw_exec_times = [
                    await asyncio.to_thread(raw_exec) for _ in range(raw_exec_samples)
                ]
                await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox.id))

        def raw_run() -> float:
            started = time.perf_counter()
            container = client.containers.run(args.image, ["true"], detach=True)
            container.wait()
            elapsed = time.perf_counter() - started
            container.remove(force=True)
            return elapsed

        raw_run()
        raw_run_times = [await asyncio.to_thread(raw_run) for _ in range(provision_samples)]

        async with _Server("local", Path(tmp) / "local", tokens_file, args.image) as server:
            async with connect(server.address, token=token) as channel:
                stub = sandbox_pb2_grpc.SandboxServiceStub(channel)
                local_times = []
                for _ in range(provision_samples + 1):
                    started = time.perf_counter()
                    sandbox = (await stub.Provision(pb.ProvisionRequest())).sandbox
                    local_times.append(time.perf_counter() - started)
                    await stub.DestroySandbox(pb.DestroySandboxRequest(sandbox_id=sandbox.id))
                local_times = local_times[1:]

    client.close()
    exec_p50, raw_exec_p50 = _p50_ms(exec_times), _p50_ms(raw_exec_times)
    provision_p50, raw_run_p50 = _p50_ms(provision_times), _p50_ms(raw_run_times)
    local_p50 = _p50_ms(local_times)
    print(f"execute(bash true) via gRPC   p50 {exec_p50:8.2f} ms  ({exec_samples} samples)")
    print(f"raw docker exec of true       p50 {raw_exec_p50:8.2f} ms  ({raw_exec_samples} samples)")
    print(
        f"provision (docker) via gRPC   p50 {provision_p50:8.2f} ms  ({provision_samples} samples)"
    )
    print(f"raw containers.run of true    p50 {raw_run_p50:8.2f} ms  ({provision_samples} samples)")
    print(f"provision (local) via gRPC    p50 {local_p50:8.2f} ms  ({provision_samples} samples)")
    print(
        f"exec_ratio={exec_p50 / raw_exec_p50:.4f} "
        f"provision_ratio={provision_p50 / raw_run_p50:.3f} "
        f"provision_local_p50_ms={local_p50:.1f}"
    )
    return 0
