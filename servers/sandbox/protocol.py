"""The host side of the executor protocol (see `executor.py` for the wire format).

Requests go one at a time over unix-socket connections that are kept open and reused (a
connection costs more than a short tool call). A connection that cannot be made, or that breaks
before the answer is complete, raises `ExecutorUnreachable`; the manager then asks the backend
whether the sandbox died.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from oma.servers.sandbox.model import ExecutionResult, SandboxError, StreamEvent

FRAME = struct.Struct(">I")
_READ_LIMIT = 1 << 24
_MAX_IDLE = 8

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ExecutorUnreachable(Exception):
    """The executor did not answer: the sandbox is dead or dying."""


class ExecutorClient:
    """Talks to one sandbox's executor; keep one instance per sandbox to reuse connections."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self._idle: list[Connection] = []

    async def _open(self) -> Connection:
        # The socket's directory is writable from inside the sandbox, so the socket may have
        # been replaced by a symbolic link to some host socket: it is opened without
        # following links and reached through the short /proc alias of that descriptor
        # (which also keeps deep data directories under the ~108-byte socket path limit).
        socket_fd = -1
        try:
            socket_fd = os.open(self.socket_path, os.O_PATH | os.O_NOFOLLOW)
            return await asyncio.open_unix_connection(
                f"/proc/self/fd/{socket_fd}", limit=_READ_LIMIT
            )
        except OSError as error:
            raise ExecutorUnreachable(f"executor socket {self.socket_path}: {error}") from error
        finally:
            if socket_fd >= 0:
                os.close(socket_fd)

    def _release(self, connection: Connection) -> None:
        if len(self._idle) < _MAX_IDLE and not connection[1].is_closing():
            self._idle.append(connection)
        else:
            connection[1].close()

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()

    async def _start(self, request: dict[str, Any]) -> tuple[Connection, dict[str, Any]]:
        """Sends a request and reads the first answer line. An idle connection that turns
        out dead (the executor restarted) is replaced once by a fresh one; nothing reached
        the executor on it, so the retry cannot run anything twice."""
        payload = json.dumps(request).encode() + b"\n"
        while True:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await self._open()
            try:
                writer.write(payload)
                await writer.drain()
                line = await reader.readline()
            except (OSError, asyncio.IncompleteReadError):
                line = b""
            if not line:
                writer.close()
                if reused:
                    continue
                raise ExecutorUnreachable("the executor closed the connection")
            event: dict[str, Any] = json.loads(line)
            if event.get("ev") == "error":
                writer.close()
                raise SandboxError(str(event["reason"]), str(event["message"]))
            return (reader, writer), event

    @staticmethod
    async def _line(reader: asyncio.StreamReader) -> dict[str, Any]:
        try:
            line = await reader.readline()
        except (OSError, asyncio.IncompleteReadError) as error:
            raise ExecutorUnreachable(str(error)) from error
        if not line:
            raise ExecutorUnreachable("the executor closed the connection")
        event: dict[str, Any] = json.loads(line)
        if event.get("ev") == "error":
            raise SandboxError(str(event["reason"]), str(event["message"]))
        return event

    async def ping(self) -> dict[str, Any]:
        connection, event = await self._start({"op": "ping"})
        self._release(connection)
        return event

    async def execute(
        self,
        *,
        execution_id: str,
        tool: str,
        tool_input: dict[str, Any] | None,
        timeout_ms: int,
        stream: bool,
        reattach_only: bool = False,
    ) -> AsyncIterator[StreamEvent]:
        """Runs (or re-attaches to) an execution; yields `started`, output (when `stream`),
        then `exited`. Request errors raise `SandboxError` before anything is yielded."""
        (reader, writer), event = await self._start(
            {
                "op": "exec",
                "id": execution_id,
                "tool": tool,
                "input": tool_input,
                "timeout_ms": timeout_ms,
                "events": stream,
                "reattach_only": reattach_only,
            }
        )
        complete = False
        try:
            while True:
                kind = event["ev"]
                if kind == "started":
                    execution_id = str(event["id"])
                    yield StreamEvent(
                        "started",
                        execution_id,
                        name=str(event["name"]),
                        reattached=bool(event["reattached"]),
                    )
                elif kind == "out":
                    yield StreamEvent(
                        str(event["stream"]),
                        execution_id,
                        data=base64.b64decode(event["data"]),
                        offset=int(event["offset"]),
                    )
                elif kind == "exited":
                    result = ExecutionResult.from_executor(event["result"])
                    complete = True
                    self._release((reader, writer))
                    yield StreamEvent("exited", execution_id, result=result)
                    return
                event = await self._line(reader)
        finally:
            if not complete:
                writer.close()

    async def put_file(
        self, path: str, chunks: AsyncIterator[bytes], *, mode: int, max_bytes: int
    ) -> dict[str, Any]:
        (reader, writer), _ready = await self._start(
            {"op": "put_file", "path": path, "mode": mode, "max_bytes": max_bytes}
        )
        try:
            sent = 0
            async for chunk in chunks:
                if not chunk:
                    continue
                sent += len(chunk)
                if sent > max_bytes:
                    raise SandboxError(
                        "FILE_TOO_LARGE",
                        f"the file is larger than the limit of {max_bytes} bytes",
                        {"limit": str(max_bytes)},
                    )
                writer.write(FRAME.pack(len(chunk)) + chunk)
                await _drain(writer)
            writer.write(FRAME.pack(0))
            await _drain(writer)
            answer = await self._line(reader)
        except BaseException:
            writer.close()
            raise
        self._release((reader, writer))
        return answer

    async def get_file(self, path: str, *, max_bytes: int) -> AsyncIterator[tuple[int, bytes]]:
        """Yields (total size, chunk) pairs; the first pair carries an empty chunk."""
        (reader, writer), header = await self._start(
            {"op": "get_file", "path": path, "max_bytes": max_bytes}
        )
        complete = False
        try:
            size = int(header["size"])
            yield size, b""
            while True:
                try:
                    (length,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                    chunk = await reader.readexactly(length) if length else b""
                except (OSError, asyncio.IncompleteReadError) as error:
                    raise ExecutorUnreachable(str(error)) from error
                if not length:
                    complete = True
                    self._release((reader, writer))
                    return
                yield size, chunk
        finally:
            if not complete:
                writer.close()

    async def untar(self, path: str, archive: bytes) -> dict[str, Any]:
        (reader, writer), _ready = await self._start({"op": "untar", "path": path})
        try:
            view = memoryview(archive)
            for start in range(0, len(archive), 1 << 20):
                piece = view[start : start + (1 << 20)]
                writer.write(FRAME.pack(len(piece)) + bytes(piece))
                await _drain(writer)
            writer.write(FRAME.pack(0))
            await _drain(writer)
            answer = await self._line(reader)
        except BaseException:
            writer.close()
            raise
        self._release((reader, writer))
        return answer


async def _drain(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
    except OSError as error:
        raise ExecutorUnreachable(str(error)) from error
