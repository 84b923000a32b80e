"""The Docker backend: one hardened container per sandbox, through the `docker` SDK.

The container's main process (under Docker's tiny init) is the executor; the workspace and the
executor's socket directory are host directories bind-mounted in, so the server reaches the
executor through a unix socket with no `docker exec` per call, and finds it again after a
restart. Containers carry labels (sandbox id, session id, the caller's labels and the whole
record), which is how a restarted server recognises its sandboxes and reaps the rest.

The engine never pulls: a missing image is `IMAGE_NOT_FOUND` (build it with
`oma sandbox build-image`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from oma.servers.sandbox.backends.base import (
    EXECUTOR_SOURCE,
    IN_SANDBOX_EXECUTOR,
    IN_SANDBOX_RUN,
    SANDBOX_GID,
    SANDBOX_UID,
    SOCKET_NAME,
    SandboxDirectories,
    wait_for_executor,
)
from oma.servers.sandbox.model import SESSION_LABEL, Sandbox, SandboxError, SandboxState

DEFAULT_IMAGE = "oma-sandbox:latest"
MANAGED_LABEL = "oma.dev/managed-by"
SANDBOX_ID_LABEL = "oma.dev/sandbox-id"
RECORD_LABEL = "oma.dev/record"
ROOT_LABEL = "oma.dev/root"
TMP_SIZE = "256m"


class DockerBackend:
    name = "docker"
    features = frozenset({"sandbox.survives_server_restart"})

    def __init__(
        self, root: Path, *, default_image: str = DEFAULT_IMAGE, client: Any = None
    ) -> None:
        import docker
        import docker.errors

        try:
            self.client = client or docker.from_env(timeout=60)
            self.client.ping()
        except docker.errors.DockerException as error:
            raise RuntimeError(f"cannot reach the Docker engine: {error}") from error
        self.dirs = SandboxDirectories(root)
        self.default_image = default_image
        self._root_label = str(root.resolve())

    def socket_path(self, sandbox_id: str) -> Path:
        return self.dirs.socket(sandbox_id)

    def container_name(self, sandbox_id: str) -> str:
        return f"oma-{sandbox_id}"

    def _labels(self, sandbox: Sandbox) -> dict[str, str]:
        labels = dict(sandbox.labels)
        labels.update(
            {
                MANAGED_LABEL: "oma-sandbox-server",
                SANDBOX_ID_LABEL: sandbox.id,
                ROOT_LABEL: self._root_label,
                RECORD_LABEL: sandbox.to_json(),
            }
        )
        if SESSION_LABEL in sandbox.labels:
            labels[SESSION_LABEL] = sandbox.labels[SESSION_LABEL]
        return labels

    def _create_and_start(self, sandbox: Sandbox, max_output_bytes: int) -> None:
        import docker.errors

        resources = sandbox.resources
        command = [
            "python3", "-I", IN_SANDBOX_EXECUTOR,
            "--socket", f"{IN_SANDBOX_RUN}/{SOCKET_NAME}",
            "--workspace", "/workspace",
            "--max-output", str(max_output_bytes),
        ]  # fmt: skip
        try:
            container = self.client.containers.create(
                sandbox.image,
                command=command,
                name=self.container_name(sandbox.id),
                labels=self._labels(sandbox),
                user=f"{SANDBOX_UID}:{SANDBOX_GID}",
                working_dir="/workspace",
                environment={"HOME": "/workspace", "LANG": "C.UTF-8"},
                hostname="sandbox",
                network_mode="none",
                cap_drop=["ALL"],
                security_opt=["no-new-privileges:true"],
                read_only=True,
                tmpfs={"/tmp": f"rw,exec,nosuid,nodev,size={TMP_SIZE}"},
                volumes={
                    str(self.dirs.workspace(sandbox.id)): {"bind": "/workspace", "mode": "rw"},
                    str(self.dirs.run(sandbox.id)): {"bind": IN_SANDBOX_RUN, "mode": "rw"},
                    str(EXECUTOR_SOURCE): {"bind": IN_SANDBOX_EXECUTOR, "mode": "ro"},
                },
                nano_cpus=resources.cpu_millis * 1_000_000,
                mem_limit=resources.memory_bytes,
                memswap_limit=resources.memory_bytes,
                pids_limit=resources.pids,
                init=True,
                ipc_mode="private",
                stdin_open=False,
                detach=True,
            )
        except docker.errors.ImageNotFound as error:
            raise SandboxError(
                "IMAGE_NOT_FOUND",
                f"the image {sandbox.image!r} is not present on this Docker engine "
                "(the server never pulls; build it with `oma sandbox build-image`)",
                {"image": sandbox.image},
            ) from error
        except docker.errors.APIError as error:
            if error.status_code != 400:
                raise
            # The engine refuses limits it cannot meet (e.g. more CPUs than the host has).
            raise SandboxError(
                "RESOURCES_EXCEED_LIMIT",
                f"the Docker engine refused the sandbox's resources: {error.explanation}",
            ) from error
        container.start()

    async def create(self, sandbox: Sandbox, max_output_bytes: int) -> Path:
        self.dirs.make(sandbox.id, SANDBOX_UID, SANDBOX_GID)
        try:
            await asyncio.to_thread(self._create_and_start, sandbox, max_output_bytes)
            await wait_for_executor(
                self.socket_path(sandbox.id), lambda: self.death_reason(sandbox.id)
            )
        except BaseException:
            await asyncio.shield(self.destroy(sandbox.id))
            raise
        return self.socket_path(sandbox.id)

    async def mark_ready(self, sandbox_id: str) -> None:
        self.dirs.mark_ready(sandbox_id)

    def _remove(self, sandbox_id: str) -> None:
        import docker.errors

        name = self.container_name(sandbox_id)
        try:
            self.client.api.remove_container(name, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as error:
            if error.status_code != 409:  # 409: a removal is already in progress
                raise
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    self.client.api.inspect_container(name)
                except docker.errors.NotFound:
                    break
                time.sleep(0.05)
        self.dirs.remove(sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        await asyncio.to_thread(self._remove, sandbox_id)

    def _death_reason(self, sandbox_id: str) -> str | None:
        import docker.errors

        try:
            state = self.client.api.inspect_container(self.container_name(sandbox_id))["State"]
        except docker.errors.NotFound:
            return "its container was removed"
        if state.get("Running") and not state.get("Paused"):
            return None
        if state.get("Paused"):
            return "its container is paused"
        oom = " after running out of memory" if state.get("OOMKilled") else ""
        return f"its container exited with status {state.get('ExitCode')}{oom}"

    async def death_reason(self, sandbox_id: str) -> str | None:
        return await asyncio.to_thread(self._death_reason, sandbox_id)

    def _recover(self) -> list[Sandbox]:
        survivors: list[Sandbox] = []
        containers = self.client.api.containers(
            all=True, filters={"label": [f"{ROOT_LABEL}={self._root_label}"]}
        )
        seen: set[str] = set()
        for summary in containers:
            labels = summary.get("Labels") or {}
            sandbox_id = labels.get(SANDBOX_ID_LABEL, "")
            seen.add(sandbox_id)
            try:
                record = Sandbox.from_json(labels[RECORD_LABEL])
            except (KeyError, ValueError, TypeError):
                record = None
            alive = summary.get("State") == "running"
            if record is None or not alive or not self.dirs.is_ready(sandbox_id):
                # An orphan: dead, half-provisioned, or not ours to understand.
                self._remove(sandbox_id)
                continue
            record.state = SandboxState.READY
            survivors.append(record)
        for sandbox_id in self.dirs.known_ids():
            if sandbox_id not in seen:
                self.dirs.remove(sandbox_id)
        return survivors

    async def recover(self) -> list[Sandbox]:
        return await asyncio.to_thread(self._recover)

    async def close(self) -> None:
        # Containers outlive the server on purpose (`sandbox.survives_server_restart`).
        await asyncio.to_thread(self.client.close)
        self.dirs.release()
