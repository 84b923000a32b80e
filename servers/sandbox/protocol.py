"""The host side of the executor protocol (see `executor.py` for the wire format).

One unix-socket connection per request. A connection that cannot be made, or that breaks
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
_MAX_SOCKET_PATH = 100


class ExecutorUnreachable(Exception):
    """The executor did not answer: the sandbox is dead or dying."""


class ExecutorClient:
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        path = str(self.socket_path)
        directory_fd = -1
        try:
            if len(path.encode()) > _MAX_SOCKET_PATH:
                # Unix socket paths are limited to ~108 bytes; a deep data directory is reached
                # through a short /proc alias of an open descriptor of its directory.
                directory_fd = os.open(self.socket_path.parent, os.O_PATH | os.O_DIRECTORY)
                path = f"/proc/self/fd/{directory_fd}/{self.socket_path.name}"
            return await asyncio.open_unix_connection(path, limit=_READ_LIMIT)
        except OSError as error:
            raise ExecutorUnreachable(f"executor socket {self.socket_path}: {error}") from error
        finally:
            if directory_fd >= 0:
                os.close(directory_fd)

    async def _request(
        self, request: dict[str, Any]
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await self._open()
        try:
            writer.write(json.dumps(request).encode() + b"\n")
            await writer.drain()
        except OSError as error:
            writer.close()
            raise ExecutorUnreachable(str(error)) from error
        return reader, writer

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
        reader, writer = await self._request({"op": "ping"})
        try:
            return await self._line(reader)
        finally:
            writer.close()

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
        reader, writer = await self._request(
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
        try:
            while True:
                event = await self._line(reader)
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
                    yield StreamEvent("exited", execution_id, result=result)
                    return
        finally:
            writer.close()

    async def put_file(
        self, path: str, chunks: AsyncIterator[bytes], *, mode: int, max_bytes: int
    ) -> dict[str, Any]:
        reader, writer = await self._request(
            {"op": "put_file", "path": path, "mode": mode, "max_bytes": max_bytes}
        )
        try:
            await self._line(reader)  # "ready", or the error about the path
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
            return await self._line(reader)
        finally:
            writer.close()

    async def get_file(self, path: str, *, max_bytes: int) -> AsyncIterator[tuple[int, bytes]]:
        """Yields (total size, chunk) pairs; the first pair may carry an empty chunk."""
        reader, writer = await self._request(
            {"op": "get_file", "path": path, "max_bytes": max_bytes}
        )
        try:
            header = await self._line(reader)
            size = int(header["size"])
            yield size, b""
            while True:
                try:
                    (length,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                    if length == 0:
                        return
                    chunk = await reader.readexactly(length)
                except (OSError, asyncio.IncompleteReadError) as error:
                    raise ExecutorUnreachable(str(error)) from error
                yield size, chunk
        finally:
            writer.close()

    async def untar(self, path: str, archive: bytes) -> dict[str, Any]:
        reader, writer = await self._request({"op": "untar", "path": path})
        try:
            await self._line(reader)
            view = memoryview(archive)
            for start in range(0, len(archive), 1 << 20):
                piece = view[start : start + (1 << 20)]
                writer.write(FRAME.pack(len(piece)) + bytes(piece))
                await _drain(writer)
            writer.write(FRAME.pack(0))
            await _drain(writer)
            return await self._line(reader)
        finally:
            writer.close()


async def _drain(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
    except OSError as error:
        raise ExecutorUnreachable(str(error)) from error
