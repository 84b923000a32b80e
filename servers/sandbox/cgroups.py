"""Per-sandbox cgroups for the local backend, on cgroup v1 or v2 (whatever the host has).

When the server runs as root (as in CI), rlimits stop nothing: a fork bomb or a memory hog is
only contained by a cgroup with `pids` and `memory` limits. Each local sandbox gets its own
group, entered by the sandbox's first process before it execs bubblewrap, so that everything
the sandbox ever spawns is counted and can be killed at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "oma-sandbox"
CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer")


class CgroupUnavailable(Exception):
    """No writable cgroup hierarchy: limits cannot be enforced."""


def cgroup_version() -> int:
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return 2
    if (CGROUP_ROOT / "memory").is_dir() and (CGROUP_ROOT / "pids").is_dir():
        return 1
    return 0


def _write(path: Path, value: str) -> None:
    path.write_text(value)


class Cgroup:
    """One sandbox's group (v1: one directory per controller; v2: one directory)."""

    def __init__(self, name: str, directories: list[Path], version: int) -> None:
        self.name = name
        self.directories = directories
        self.version = version

    @property
    def procs_files(self) -> list[Path]:
        """Where to write a pid to move that process into the group (every hierarchy)."""
        return [d / "cgroup.procs" for d in self.directories]

    @classmethod
    def create(cls, name: str, *, memory_bytes: int, pids: int, cpu_millis: int) -> Cgroup:
        version = cgroup_version()
        try:
            if version == 1:
                return cls._create_v1(name, memory_bytes, pids, cpu_millis)
            if version == 2:
                return cls._create_v2(name, memory_bytes, pids, cpu_millis)
        except OSError as error:
            raise CgroupUnavailable(f"cannot set up the cgroup for {name}: {error}") from error
        raise CgroupUnavailable("no cgroup v1 or v2 hierarchy is mounted at /sys/fs/cgroup")

    @classmethod
    def _create_v1(cls, name: str, memory_bytes: int, pids: int, cpu_millis: int) -> Cgroup:
        directories = []
        for controller in V1_CONTROLLERS:
            hierarchy = CGROUP_ROOT / controller
            if not hierarchy.is_dir():
                if controller in ("memory", "pids"):
                    raise CgroupUnavailable(f"the cgroup v1 {controller} controller is missing")
                continue
            directory = hierarchy / PARENT / name
            directory.mkdir(parents=True, exist_ok=True)
            directories.append(directory)
            if controller == "memory":
                _write(directory / "memory.limit_in_bytes", str(memory_bytes))
                swap = directory / "memory.memsw.limit_in_bytes"
                if swap.exists():  # only with swap accounting; then no swap on top of memory
                    _write(swap, str(memory_bytes))
            elif controller == "pids":
                _write(directory / "pids.max", str(pids))
            elif controller == "cpu" and (directory / "cpu.cfs_quota_us").exists():
                _write(directory / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(directory / "cpu.cfs_quota_us", str(cpu_millis * CPU_PERIOD_US // 1000))
        return cls(name, directories, 1)

    @classmethod
    def _create_v2(cls, name: str, memory_bytes: int, pids: int, cpu_millis: int) -> Cgroup:
        parent = CGROUP_ROOT / PARENT
        parent.mkdir(exist_ok=True)
        available = set((CGROUP_ROOT / "cgroup.controllers").read_text().split())
        wanted = [c for c in ("memory", "pids", "cpu") if c in available]
        if not {"memory", "pids"} <= set(wanted):
            raise CgroupUnavailable("the cgroup v2 memory and pids controllers are not available")
        enable = " ".join(f"+{c}" for c in wanted)
        for level in (CGROUP_ROOT, parent):
            with contextlib.suppress(OSError):
                _write(level / "cgroup.subtree_control", enable)
        directory = parent / name
        directory.mkdir(exist_ok=True)
        _write(directory / "memory.max", str(memory_bytes))
        with contextlib.suppress(OSError):
            _write(directory / "memory.swap.max", "0")
        _write(directory / "pids.max", str(pids))
        if "cpu" in wanted:
            _write(directory / "cpu.max", f"{cpu_millis * CPU_PERIOD_US // 1000} {CPU_PERIOD_US}")
        return cls(name, [directory], 2)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for procs in self.procs_files:
            with contextlib.suppress(OSError):
                found.update(int(line) for line in procs.read_text().split())
        return found

    def kill_all(self) -> None:
        """Kills every process in the group, including the ones a fork bomb adds meanwhile."""
        if self.version == 2:
            kill_file = self.directories[0] / "cgroup.kill"
            if kill_file.exists():
                with contextlib.suppress(OSError):
                    _write(kill_file, "1")
        freezer = next((d for d in self.directories if d.parent.parent.name == "freezer"), None)
        if freezer is not None:
            # Frozen processes cannot fork, so one pass of SIGKILL reaches all of them.
            with contextlib.suppress(OSError):
                _write(freezer / "freezer.state", "FROZEN")
        for _ in range(200):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if freezer is not None:
                with contextlib.suppress(OSError):
                    _write(freezer / "freezer.state", "THAWED")
            time.sleep(0.01)

    def remove(self) -> None:
        self.kill_all()
        for directory in self.directories:
            for _ in range(100):
                try:
                    directory.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)

    @classmethod
    def leftovers(cls) -> list[Cgroup]:
        """Groups of sandboxes from a server process that died without cleaning up."""
        version = cgroup_version()
        names: set[str] = set()
        if version == 1:
            for controller in V1_CONTROLLERS:
                parent = CGROUP_ROOT / controller / PARENT
                if parent.is_dir():
                    names.update(p.name for p in parent.iterdir() if p.is_dir())
        elif version == 2 and (CGROUP_ROOT / PARENT).is_dir():
            names.update(p.name for p in (CGROUP_ROOT / PARENT).iterdir() if p.is_dir())
        groups = []
        for name in sorted(names):
            if version == 1:
                dirs = [
                    CGROUP_ROOT / c / PARENT / name
                    for c in V1_CONTROLLERS
                    if (CGROUP_ROOT / c / PARENT / name).is_dir()
                ]
            else:
                dirs = [CGROUP_ROOT / PARENT / name]
            groups.append(cls(name, dirs, version))
        return groups
