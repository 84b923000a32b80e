"""The local backend: bubblewrap namespaces, for machines without Docker.

Each sandbox is a `bwrap` jail with every namespace unshared (so no network but loopback),
running as an unprivileged user with no capabilities. Its root is an empty read-only tmpfs
holding only `/usr`, `/bin`, `/sbin`, `/lib*` and a minimal `/etc`, all read-only, plus a
private `/tmp`, the workspace and the executor's socket directory. Nothing else of the host
(`/`, home directories, the OMA data directory, key files) exists inside. The jail's first
process enters a cgroup of its own before exec'ing bubblewrap, so pids and memory limits hold
even when the server runs as root.

Sandboxes die with the server (`--die-with-parent`): this backend does not advertise
`sandbox.survives_server_restart`, and a restarted server reaps what a crashed one left.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import signal
from pathlib import Path

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
from oma.servers.sandbox.cgroups import Cgroup, CgroupUnavailable
from oma.servers.sandbox.model import Sandbox, SandboxError

HOST_IMAGE = "host"
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Host files of /etc a process needs to run (dynamic linker cache, alternatives symlinks,
# CA certificates); passwd, group and hosts are generated instead. Of /etc/ssl only the
# public parts: with a root server the sandbox user is host root in a user namespace, and
# as the owner it could read root's 0600 keys in /etc/ssl/private.
ETC_FROM_HOST = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl/certs",
                 "ssl/openssl.cnf", "localtime", "nsswitch.conf", "mime.types", "bash.bashrc",
                 "profile")  # fmt: skip
ETC_GENERATED = {
    "passwd": f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:OMA sandbox:/workspace:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "group": f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    "hostname": "sandbox\n",
}


class LocalBackend:
    name = "local"
    features: frozenset[str] = frozenset()
    default_image = HOST_IMAGE

    def __init__(self, root: Path, *, bwrap: str | None = None) -> None:
        found = bwrap or shutil.which("bwrap")
        if found is None:
            raise RuntimeError("bubblewrap (`bwrap`) is not installed: apt-get install bubblewrap")
        self.bwrap = found
        try:
            Cgroup.create(
                f"probe-{os.getpid()}-{secrets.token_hex(3)}",
                memory_bytes=1 << 30,
                pids=64,
                cpu_millis=1000,
            ).remove()
        except CgroupUnavailable as error:
            raise RuntimeError(
                f"the local backend limits each sandbox with a cgroup, and cannot: {error} "
                "(run the sandbox server as root on a host with cgroup v1 or v2)"
            ) from error
        # Jails die with their server, so nothing is shared between server processes: each one
        # works in an instance directory of its own under `root` (several servers may share a
        # root), and reaps the instances whose server died (their lock is free).
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        reap_dead_instances(root)
        self.instance = root / f"i-{os.getpid()}-{secrets.token_hex(4)}"
        self.dirs = SandboxDirectories(self.instance)
        self.cgroup_prefix = cgroup_prefix(self.instance)
        root = self.instance
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.cgroups: dict[str, Cgroup] = {}
        self.etc = root / "_etc"
        self._write_etc()
        # A copy the sandbox user can read wherever the server's own files are.
        self.executor = root / "_bin" / "executor.py"
        self.executor.parent.mkdir(exist_ok=True)
        shutil.copyfile(EXECUTOR_SOURCE, self.executor)
        os.chmod(self.executor.parent, 0o755)
        os.chmod(self.executor, 0o644)

    def _write_etc(self) -> None:
        self.etc.mkdir(exist_ok=True)
        for name, content in ETC_GENERATED.items():
            (self.etc / name).write_text(content)
            os.chmod(self.etc / name, 0o644)
        os.chmod(self.etc, 0o755)

    def socket_path(self, sandbox_id: str) -> Path:
        return self.dirs.socket(sandbox_id)

    def _bwrap_args(self, sandbox: Sandbox, max_output_bytes: int) -> list[str]:
        args = [
            self.bwrap,
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_GID),
            "--hostname", "sandbox",
            "--cap-drop", "ALL",
        ]  # fmt: skip
        for name in SYSTEM_DIRS:
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{name}"]
        args += ["--dir", "/etc"]
        for name in ETC_GENERATED:
            args += ["--ro-bind", str(self.etc / name), f"/etc/{name}"]
        for name in ETC_FROM_HOST:
            if (Path("/etc") / name).exists():
                args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        args += [
            "--proc", "/proc",
            "--dev", "/dev",
            "--tmpfs", "/tmp",
            "--bind", str(self.dirs.workspace(sandbox.id)), "/workspace",
            "--bind", str(self.dirs.run(sandbox.id)), IN_SANDBOX_RUN,
            "--ro-bind", str(self.executor), IN_SANDBOX_EXECUTOR,
            "--remount-ro", "/",
            "--chdir", "/workspace",
            "--",
            "/usr/bin/python3", "-I", IN_SANDBOX_EXECUTOR,
            "--socket", f"{IN_SANDBOX_RUN}/{SOCKET_NAME}",
            "--workspace", "/workspace",
            "--max-output", str(max_output_bytes),
        ]  # fmt: skip
        return args

    async def create(self, sandbox: Sandbox, max_output_bytes: int) -> Path:
        if sandbox.image != HOST_IMAGE:
            raise SandboxError(
                "IMAGE_NOT_FOUND",
                f"the local backend runs the host's system directories only; image "
                f"{sandbox.image!r} is not available (leave it empty or use {HOST_IMAGE!r})",
                {"image": sandbox.image},
            )
        # bubblewrap maps the sandbox user onto the server's own uid, so the server owns
        # the directories (in its user namespace the sandbox has no capability outside).
        self.dirs.make(sandbox.id, os.geteuid(), os.getegid())
        try:
            resources = sandbox.resources
            cgroup = await asyncio.to_thread(
                Cgroup.create,
                f"{self.cgroup_prefix}-{sandbox.id}",
                memory_bytes=resources.memory_bytes,
                pids=resources.pids,
                cpu_millis=resources.cpu_millis,
            )
        except CgroupUnavailable as error:
            self.dirs.remove(sandbox.id)
            raise SandboxError(
                "INTERNAL",
                f"the local backend cannot limit this sandbox: {error} "
                "(run the server as root on a host with cgroups)",
            ) from error
        self.cgroups[sandbox.id] = cgroup
        try:
            # The first process joins the cgroup and only then becomes bubblewrap, so that
            # nothing of the sandbox ever runs outside its limits.
            join = " ".join(f'echo $$ > "{p}" &&' for p in cgroup.procs_files)
            command = list(self._bwrap_args(sandbox, max_output_bytes))
            self.processes[sandbox.id] = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", f'{join} exec "$@"', "oma-sandbox", *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                     "HOME": "/workspace"},
            )  # fmt: skip
            await wait_for_executor(
                self.socket_path(sandbox.id), lambda: self.death_reason(sandbox.id)
            )
        except BaseException:
            await asyncio.shield(self.destroy(sandbox.id))
            raise
        return self.socket_path(sandbox.id)

    async def mark_ready(self, sandbox_id: str) -> None:
        self.dirs.mark_ready(sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        process = self.processes.pop(sandbox_id, None)
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
        cgroup = self.cgroups.pop(sandbox_id, None)
        if cgroup is not None:
            await asyncio.to_thread(cgroup.remove)
        if process is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(process.wait(), 10)
        self.dirs.remove(sandbox_id)

    async def death_reason(self, sandbox_id: str) -> str | None:
        process = self.processes.get(sandbox_id)
        if process is None:
            return "its bubblewrap process is gone"
        if process.returncode is None:
            return None
        detail = b""
        if process.stderr is not None:
            with contextlib.suppress(Exception):
                detail = await asyncio.wait_for(process.stderr.read(2000), 1)
        message = detail.decode(errors="replace").strip()
        return f"its bubblewrap process exited with status {process.returncode}" + (
            f": {message}" if message else ""
        )

    async def recover(self) -> list[Sandbox]:
        # Nothing survives a restart of this backend: a previous process's jails died with it,
        # and its instance directory was reaped when this one was made.
        return []

    async def close(self) -> None:
        for sandbox_id in list(self.processes):
            await self.destroy(sandbox_id)
        self.dirs.release()
        shutil.rmtree(self.instance, ignore_errors=True)


def cgroup_prefix(instance: Path) -> str:
    """Cgroups are named after their instance, so servers never touch each other's."""
    return "r" + hashlib.sha256(str(instance.resolve()).encode()).hexdigest()[:10]


def reap_dead_instances(root: Path) -> None:
    """Removes what servers that died without cleaning up left under `root`: their cgroups
    (killing any process still in them) and their instance directories."""
    for instance in root.glob("i-*"):
        try:
            fd = os.open(instance / ".lock", os.O_RDWR)
        except OSError:
            shutil.rmtree(instance, ignore_errors=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its server is alive
        finally:
            os.close(fd)
        prefix = cgroup_prefix(instance) + "-"
        for cgroup in Cgroup.leftovers():
            if cgroup.name.startswith(prefix):
                cgroup.remove()
        shutil.rmtree(instance, ignore_errors=True)
