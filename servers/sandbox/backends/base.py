"""What a backend does for the manager: create and destroy the isolated machine that runs the
executor, tell whether it is still alive, and find survivors after a server restart.

Every backend uses the same host-side layout under its root directory:

    <root>/<sandbox id>/workspace   mounted at /workspace inside the sandbox
    <root>/<sandbox id>/run         mounted at /oma/run: the executor's socket lives here
    <root>/<sandbox id>/ready       written once the init steps are done

so that the manager talks to every sandbox the same way, through `run/executor.sock`. The
ready marker lies outside the mounted directories: code in the sandbox can write `run/`, so
a marker there could be forged (a half-provisioned sandbox recovered as ready) or replaced
by a symbolic link the server would then write through on the host.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Protocol

from oma.servers.sandbox.model import Sandbox, SandboxError
from oma.servers.sandbox.protocol import ExecutorClient, ExecutorUnreachable

EXECUTOR_SOURCE = Path(__file__).resolve().parent.parent / "executor.py"
SANDBOX_UID = 1000
SANDBOX_GID = 1000
IN_SANDBOX_EXECUTOR = "/oma/executor.py"
IN_SANDBOX_RUN = "/oma/run"
SOCKET_NAME = "executor.sock"
READY_MARKER = "ready"
STARTUP_TIMEOUT_SECONDS = 60.0


class Backend(Protocol):
    """A place sandboxes run. Implementations: `DockerBackend`, `LocalBackend`."""

    name: str
    features: frozenset[str]
    default_image: str

    async def create(self, sandbox: Sandbox, max_output_bytes: int) -> Path:
        """Starts the sandbox with its executor; returns the executor socket once it answers.
        Raises `SandboxError` (e.g. `IMAGE_NOT_FOUND`) and leaves nothing behind on failure."""
        ...

    async def mark_ready(self, sandbox_id: str) -> None:
        """Records that the init steps are done (what `recover` trusts after a restart)."""
        ...

    async def destroy(self, sandbox_id: str) -> None:
        """Kills everything of the sandbox and removes its files. Idempotent."""
        ...

    async def death_reason(self, sandbox_id: str) -> str | None:
        """None while the sandbox runs; otherwise why it is gone, for people."""
        ...

    async def recover(self) -> list[Sandbox]:
        """Live, ready sandboxes left by a previous server process (reaping the rest)."""
        ...

    def socket_path(self, sandbox_id: str) -> Path: ...

    async def close(self) -> None: ...


class SandboxDirectories:
    """The host-side directories of one backend's sandboxes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # Only the server may look inside: sockets in here run code in the sandboxes.
        os.chmod(root, 0o700)
        # One server per root: a second one would reap the first one's sandboxes at start.
        self._lock_fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(
                f"another sandbox server is using {root}; give this one its own --root"
            ) from None

    def release(self) -> None:
        """Lets another server process take over this root (after a restart, say)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def base(self, sandbox_id: str) -> Path:
        return self.root / sandbox_id

    def workspace(self, sandbox_id: str) -> Path:
        return self.base(sandbox_id) / "workspace"

    def run(self, sandbox_id: str) -> Path:
        return self.base(sandbox_id) / "run"

    def socket(self, sandbox_id: str) -> Path:
        return self.run(sandbox_id) / SOCKET_NAME

    def is_ready(self, sandbox_id: str) -> bool:
        return (self.base(sandbox_id) / READY_MARKER).exists()

    def mark_ready(self, sandbox_id: str) -> None:
        (self.base(sandbox_id) / READY_MARKER).write_text(str(time.time()))

    def make(self, sandbox_id: str, uid: int, gid: int) -> None:
        base = self.base(sandbox_id)
        base.mkdir(mode=0o755)
        for directory in (self.workspace(sandbox_id), self.run(sandbox_id)):
            directory.mkdir(mode=0o755)
            if os.geteuid() == 0:
                os.chown(directory, uid, gid)
            else:
                # Without root the sandbox user cannot be given the directories, so they are
                # opened up instead; the 0700 root above still keeps other users out.
                os.chmod(directory, 0o777)

    def remove(self, sandbox_id: str) -> None:
        shutil.rmtree(self.base(sandbox_id), ignore_errors=True)

    def known_ids(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if p.is_dir() and p.name.startswith("sb-")]


async def wait_for_executor(
    socket: Path, is_dead: object, limit_seconds: float = STARTUP_TIMEOUT_SECONDS
) -> None:
    """Polls until the executor answers a ping. `is_dead` is an async callable returning a
    reason when the sandbox died while starting."""
    client = ExecutorClient(socket)
    deadline = time.monotonic() + limit_seconds
    delay = 0.002
    next_check = time.monotonic() + 0.25
    while True:
        if socket.exists():  # noqa: ASYNC240 - a stat of a local file
            try:
                await client.ping()
                client.close()
                return
            except ExecutorUnreachable:
                pass
        now = time.monotonic()
        if now >= next_check:
            reason = await is_dead()  # type: ignore[operator]
            if reason:
                raise SandboxError("INTERNAL", f"the sandbox died while starting: {reason}")
            next_check = now + 0.25
        if now > deadline:
            raise SandboxError(
                "INTERNAL", f"the sandbox executor did not start within {limit_seconds:.0f} s"
            )
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.02)
