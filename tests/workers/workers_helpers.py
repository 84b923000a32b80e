"""Helpers of the worker tests: every server is a child process started the way users start it
(`oma serve session` on PostgreSQL, `oma serve sandbox --backend local`, `oma model-server`,
`oma serve harness --worker`), and a client of the session service."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oma.runtime.auth import TokenTable
from oma.runtime.client import connect
from oma.session.v1 import (
    definition_pb2,
    events_pb2,
    session_service_pb2,
    session_service_pb2_grpc,
)

STARTUP_SECONDS = 60.0  # hang protection only


@dataclass
class Launched:
    """A child `python -m oma.cli.main ...` whose readiness line is still awaited."""

    args: Sequence[str]
    proc: subprocess.Popen[bytes]
    log: Path
    ready: str

    def address(self) -> str:
        """Wait for the line matching `ready` (group 1: the address it serves on)."""
        pattern = re.compile(self.ready)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            match = pattern.search(self.log.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        raise RuntimeError(
            f"`oma {' '.join(self.args[:2])}` did not start:\n{self.log.read_text()[-3000:]}"
        )


def launch(
    args: Sequence[str], log: Path, ready: str, env: dict[str, str] | None = None
) -> Launched:
    """Start `python -m oma.cli.main ARGS` without waiting for it (several start at once)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "oma.cli.main", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
    return Launched(args, proc, log, ready)


def spawn(
    args: Sequence[str], log: Path, ready: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a child and wait until it serves; returns it and its address."""
    launched = launch(args, log, ready, env)
    return launched.proc, launched.address()


def stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> list[int]:
    """SIGTERM every process at once, then wait for each (SIGKILL after 20 s)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def stop(proc: subprocess.Popen[bytes]) -> int:
    return stop_all([proc])[0]


def launch_session(log: Path, tokens_file: Path, db: str, listen: str = "127.0.0.1:0") -> Launched:
    args = ["serve", "session", "--listen", listen, "--grace-seconds", "1"]
    args += ["--tokens", str(tokens_file), "--db", db]
    return launch(args, log, r"oma session serving on (\S+)")


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def started(self) -> list[str]:
        """Ids of the sessions whose turn this worker started, in order."""
        return re.findall(r"session (\S+): turn started from a push", self.text())

    def pushed(self) -> list[str]:
        return re.findall(r"session (\S+) pushed \(last seq", self.text())

    def most_at_once(self) -> int:
        """The most sessions this worker drove at one time, read from its log (a turn starts
        with "turn started from a push" and ends with the driver's "idle:" line)."""
        now = most = 0
        for line in self.text().splitlines():
            if "turn started from a push" in line:
                now += 1
                most = max(most, now)
            elif re.search(r"session \S+ idle: ", line):
                now -= 1
        return most

    def streams(self) -> int:
        return len(re.findall(r"watching pending sessions \(stream \d+\)", self.text()))


@dataclass
class Stack:
    """Session (PostgreSQL), sandbox (local) and model servers; workers started on demand."""

    tmp: Path
    tokens: TokenTable
    tokens_file: Path
    session: str
    sandbox: str
    model_url: str
    db: str
    # Child processes to stop at the end, the session server's first.
    procs: list[subprocess.Popen[bytes]]
    workers: list[WorkerProc] = field(default_factory=list)

    def restart_session(self) -> None:
        """Stop the session server (SIGTERM: its streams end with UNAVAILABLE) and start it
        again on the same address and database."""
        assert stop(self.procs[0]) == 0
        restarts = sum(1 for _ in self.tmp.glob("session*.log"))
        launched = launch_session(
            self.tmp / f"session-{restarts}.log", self.tokens_file, self.db, self.session
        )
        self.procs[0] = launched.proc
        launched.address()

    def start_worker(
        self, name: str, *, lease_ttl_seconds: float = 2.0, max_sessions: int = 4
    ) -> WorkerProc:
        log = self.tmp / f"worker-{name}.log"
        proc, _ = spawn(
            [
                "serve",
                "harness",
                "--worker",
                "--listen",
                "127.0.0.1:0",
                "--grace-seconds",
                "1",
                "--tokens",
                str(self.tokens_file),
                "--session",
                self.session,
                "--sandbox",
                self.sandbox,
                "--model-base-url",
                self.model_url,
                "--lease-ttl-seconds",
                str(lease_ttl_seconds),
                "--max-sessions",
                str(max_sessions),
            ],
            log,
            r"oma harness serving on (\S+)",
            env={"OMA_LOG_LEVEL": "INFO"},
        )
        worker = WorkerProc(name, proc, log)
        self.workers.append(worker)
        return worker


class Client:
    """A client of the real session service (client role)."""

    def __init__(self, stack: Stack) -> None:
        self._channel = connect(stack.session, token=stack.tokens.token_for("client"))
        self.stub = session_service_pb2_grpc.SessionServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(None)

    async def create(self, script: str, prompt: str = "go") -> str:
        definition = definition_pb2.SessionDefinition(
            model="claude-sonnet-5",
            system_prompt=f"You are a test agent. [script:{script}]",
            tools=[definition_pb2.BuiltinTool(name="bash")],
        )
        created = await self.stub.CreateSession(
            session_service_pb2.CreateSessionRequest(
                request_id=uuid.uuid4().hex, definition=definition
            )
        )
        session_id: str = created.session.id
        await self.stub.AppendEvents(
            session_service_pb2.AppendEventsRequest(
                session_id=session_id,
                events=[
                    events_pb2.Event(
                        id=f"user-{uuid.uuid4().hex[:8]}",
                        user_message=events_pb2.UserMessage(
                            content=[events_pb2.ContentBlock(text=f"{prompt} ({session_id})")]
                        ),
                    )
                ],
            )
        )
        return session_id

    async def append_interrupt(self, session_id: str) -> None:
        await self.stub.AppendEvents(
            session_service_pb2.AppendEventsRequest(
                session_id=session_id,
                events=[
                    events_pb2.Event(
                        id=f"interrupt-{uuid.uuid4().hex[:8]}",
                        user_interrupt=events_pb2.UserInterrupt(reason="test"),
                    )
                ],
            )
        )

    async def status(self, session_id: str) -> Any:
        response = await self.stub.GetSession(
            session_service_pb2.GetSessionRequest(session_id=session_id)
        )
        return response.session

    async def done(self, session_id: str) -> bool:
        session = await self.status(session_id)
        return bool(
            session.status == session_service_pb2.SESSION_STATUS_IDLE
            and session.stop_reason != events_pb2.STOP_REASON_UNSPECIFIED
        )

    async def wait_done(self, session_ids: Sequence[str], limit_seconds: float) -> None:
        """Wait until every session has gone idle after a turn (hang protection: the limit)."""
        waiting = set(session_ids)
        deadline = time.monotonic() + limit_seconds
        while waiting:
            finished = [s for s in waiting if await self.done(s)]
            waiting.difference_update(finished)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(waiting)} session(s) never finished: {sorted(waiting)}")
            await asyncio.sleep(0.2)

    async def events(self, session_id: str) -> list[events_pb2.Event]:
        out: list[events_pb2.Event] = []
        token = ""
        while True:
            response = await self.stub.GetEvents(
                session_service_pb2.GetEventsRequest(
                    session_id=session_id, page_size=1000, page_token=token
                )
            )
            out.extend(response.events)
            token = response.next_page_token
            if not token:
                return out


def check_complete(events: Sequence[events_pb2.Event], final_text: str) -> None:
    """The log ends idle with end_turn after the scripted final answer, with no gap in its
    seqs and no event id twice."""
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(events) + 1)), f"gap or disorder in seqs: {seqs}"
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids), f"duplicate event ids: {ids}"
    last = events[-1]
    assert last.type == "session.status_idle", [e.type for e in events]
    assert last.session_status_idle.stop_reason == events_pb2.STOP_REASON_END_TURN
    messages = [
        b.text for e in events if e.type == "agent.message" for b in e.agent_message.content
    ]
    assert messages and messages[-1] == final_text, messages


def tool_outputs(events: Sequence[events_pb2.Event]) -> list[str]:
    return [
        "".join(b.text for b in e.agent_tool_result.content)
        for e in events
        if e.type == "agent.tool_result"
    ]


def write_script(path: Path, scripts: dict[str, Any]) -> Path:
    path.write_text(json.dumps({"scripts": scripts}))
    return path
