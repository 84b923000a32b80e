"""Running the four OMA servers as child processes on this machine (`oma up`, `oma run`,
`oma demo`).

Each server is `python -m oma.cli.main serve <name> ...`, with its output in
`<data dir>/logs/<name>.log`; its address is read from the `oma <name> serving on ADDRESS`
line it prints. A running `oma up` records its addresses in `<data dir>/up.json`, which is how
`oma run` finds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "up.json"
DEFAULT_PORTS = {"session": 50051, "sandbox": 50052, "vault": 50053, "harness": 50054}


@dataclass
class StackInfo:
    """Where a running stack's servers listen, and its token file."""

    session: str
    sandbox: str
    vault: str
    harness: str
    tokens_file: str
    sandbox_backend: str
    pid: int = 0
    model_base_url: str = ""


@dataclass
class Stack:
    info: StackInfo
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    data_dir: Path = Path()

    def stop(self, grace_seconds: float = 15.0) -> None:
        """SIGTERM the harness first (it may still write its last events), then the other
        servers together; SIGKILL whatever outlives the grace period."""
        for group in (["harness"], ["sandbox", "vault", "session"]):
            procs = [self.processes[n] for n in group if n in self.processes]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_seconds
            for proc in procs:
                while proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        state = self.data_dir / STATE_FILE
        try:
            if json.loads(state.read_text()).get("pid") == os.getpid():
                state.unlink()
        except (OSError, ValueError):
            pass

    def dead(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() is not None]


def docker_usable(image: str) -> bool:
    """Whether a Docker engine answers and has the sandbox image."""
    try:
        import docker

        client = docker.from_env(timeout=5)
        try:
            client.images.get(image)
            return True
        finally:
            client.close()
    except Exception:
        return False


def choose_backend(requested: str, image: str) -> str:
    if requested != "auto":
        return requested
    if docker_usable(image):
        return "docker"
    if shutil.which("bwrap"):
        return "local"
    raise SystemExit(
        "no sandbox backend: start Docker and build the image (`oma sandbox build-image`), "
        "or install bubblewrap (`apt-get install bubblewrap`)"
    )


def _wait_for_address(name: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> str:
    pattern = re.compile(rf"oma {name} serving on (\S+)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        match = pattern.search(text)
        if match:
            return match.group(1)
        if proc.poll() is not None:
            tail = "\n".join(text.splitlines()[-15:])
            raise RuntimeError(f"oma serve {name} exited with {proc.returncode}:\n{tail}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"oma serve {name} did not start within {timeout:.0f}s (see {log})")


def _spawn(name: str, args: list[str], logs: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log = logs / f"{name}.log"
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "oma.cli.main", "serve", name, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )  # Ctrl-C reaches us; we stop the children in order


def start_stack(
    data_dir: Path,
    *,
    backend: str = "auto",
    fixed_ports: bool = True,
    model_base_url: str = "",
    sandbox_image: str = "",
    startup_timeout: float = 60.0,
    record: bool = True,
    grace_seconds: float | None = None,
) -> Stack:
    """Start session (SQLite), sandbox, vault and harness; return once all four serve.

    `fixed_ports` uses the default ports 50051-50054 (`oma up`); otherwise free ports are
    picked (an embedded stack that must not clash with a running one).
    """
    from oma.runtime.paths import ensure_tokens_file

    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)
    tokens = ensure_tokens_file(data_dir / "tokens.json")
    image = sandbox_image or os.environ.get("OMA_SANDBOX_IMAGE", "oma-sandbox:latest")
    chosen = choose_backend(backend, image)
    env = {**os.environ, "OMA_HOME": str(data_dir)}

    def listen(name: str) -> str:
        return f"127.0.0.1:{DEFAULT_PORTS[name] if fixed_ports else 0}"

    common = ["--tokens", str(tokens)]
    if grace_seconds is not None:
        common += ["--grace-seconds", str(grace_seconds)]
    stack = Stack(
        StackInfo("", "", "", "", str(tokens), chosen, os.getpid(), model_base_url),
        data_dir=data_dir,
    )
    try:
        # Each server is started once the one it depends on serves: the vault checks
        # harness-issued session tokens against the session service, and the sandbox clones
        # credentialed repositories through the vault.
        specs: list[tuple[str, list[str]]] = [
            (
                "session",
                ["--listen", listen("session"), "--db", f"sqlite:///{data_dir / 'sessions.db'}"],
            ),
            (
                "vault",
                [
                    "--listen",
                    listen("vault"),
                    "--db",
                    f"sqlite:///{data_dir / 'vault.db'}",
                    "--session",
                    "{session}",
                ],
            ),
            (
                "sandbox",
                ["--listen", listen("sandbox"), "--backend", chosen, "--vault", "{vault}"]
                + (["--image", image] if chosen == "docker" and sandbox_image else []),
            ),
        ]
        for name, args in specs:
            resolved = [a.format(session=stack.info.session, vault=stack.info.vault) for a in args]
            stack.processes[name] = _spawn(name, resolved + common, logs, env)
            address = _wait_for_address(
                name, stack.processes[name], logs / f"{name}.log", startup_timeout
            )
            setattr(stack.info, name, address)
        harness_args = [
            "--listen",
            listen("harness"),
            "--session",
            stack.info.session,
            "--sandbox",
            stack.info.sandbox,
            "--vault",
            stack.info.vault,
        ]
        if model_base_url:
            harness_args += ["--model-base-url", model_base_url]
        stack.processes["harness"] = _spawn("harness", harness_args + common, logs, env)
        stack.info.harness = _wait_for_address(
            "harness", stack.processes["harness"], logs / "harness.log", startup_timeout
        )
    except BaseException:
        stack.stop(grace_seconds=3)
        raise
    if record:
        (data_dir / STATE_FILE).write_text(json.dumps(asdict(stack.info), indent=2))
    return stack


def running_stack(data_dir: Path) -> StackInfo | None:
    """The stack a live `oma up` recorded in `data_dir`, if its process still runs."""
    try:
        info = StackInfo(**json.loads((data_dir / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    try:
        os.kill(info.pid, 0)
    except (ProcessLookupError, PermissionError):
        return None
    return info
