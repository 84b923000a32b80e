"""The in-sandbox executor: a small, long-lived program started when a sandbox is created.

It runs *inside* the sandbox (container or bubblewrap jail) as the sandbox user, listens on a
unix socket in a directory the sandbox server can also reach, and runs the built-in tools, one
fresh child process per `bash` call, so that a tool call costs a fork and an exec rather than a
`docker exec` set-up. It keeps the record of every execution by id, so a repeated id never runs
twice and a client can re-attach to a running execution, even after the sandbox server restarted.

Stdlib only, Python 3.11+: it must run on any image with `python3`.

Wire protocol (requests one after another on a connection): the client sends one JSON line,
optionally followed by binary frames (4-byte big-endian length, then the bytes; a zero length
ends the data). The executor answers with JSON lines (and frames for `get_file`). Every request
error is a line `{"ev": "error", "reason": REASON, "message": TEXT}` with REASON an OMA
`ErrorReason` name, after which the executor closes the connection.
"""

# The executor owns its sandbox: local file operations in its event loop are short and
# cannot stall anyone else, so the async-blocking lints do not apply here.
# ruff: noqa: ASYNC109, ASYNC230, ASYNC240

from __future__ import annotations

import argparse
import asyncio
import base64
import codecs
import collections
import contextlib
import hashlib
import json
import os
import re
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from typing import Any

STREAM_REPLAY_BYTES = 1 << 20
REPLAY_IN_MEMORY_BYTES = 16 * 1024
RECORD_SECONDS = 3600
DEFAULT_TIMEOUT_MS = 120_000
MAX_TIMEOUT_MS = 600_000
DEFAULT_MAX_OUTPUT = 64 * 1024
READ_DEFAULT_LIMIT = 2000
READ_MAX_LINE_CHARS = 2000
OUTPUT_DIR_NAME = ".oma/outputs"
FRAME = struct.Struct(">I")
CHUNK = 64 * 1024
TOOLS = ("bash", "read", "write", "edit", "glob", "grep")
# A shell started ahead of its call: it reads the whole command from stdin, then runs it.
WARM_SHELL = ["/bin/bash", "-c", "source /dev/stdin"]
WARM_SHELLS = 2
WARM_COMMAND_MAX = 32 * 1024  # longer commands get a shell of their own (`bash -c`)


class RequestError(Exception):
    """A request the executor refuses before running anything; becomes an RPC error."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class ToolFailure(Exception):
    """A tool ran and failed: an `is_error` result, never an RPC error."""


# --------------------------------------------------------------------------- paths


class Workspace:
    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)

    def resolve(self, path: Any, *, field: str = "path") -> str:
        if not isinstance(path, str) or not path:
            raise RequestError("INVALID_TOOL_INPUT", f"`{field}` must be a non-empty string")
        if "\x00" in path:
            raise RequestError("INVALID_TOOL_INPUT", f"`{field}` contains a NUL byte")
        joined = path if os.path.isabs(path) else os.path.join(self.root, path)
        resolved = os.path.realpath(joined)
        if resolved != self.root and not resolved.startswith(self.root + os.sep):
            raise RequestError(
                "PATH_OUTSIDE_WORKSPACE",
                f"{path!r} resolves to {resolved!r}, outside the workspace {self.root}; "
                "give a path inside the workspace",
            )
        return resolved

    def relative(self, path: str) -> str:
        return os.path.relpath(path, self.root)


# --------------------------------------------------------------------------- output shaping


class OutputCollector:
    """Keeps what a result needs of an output of any size: all of it while it fits the cap,
    then the head, a ring of the tail, and the whole in a file inside the sandbox."""

    def __init__(self, cap: int, spill_path: str) -> None:
        self.cap = max(cap, 256)
        self.spill_path = spill_path
        self.total = 0
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_bytes = 0
        self.spill: Any = None

    def add(self, data: bytes) -> None:
        self.total += len(data)
        if self.spill is None and len(self.head) + len(data) <= self.cap:
            self.head += data
            return
        if self.spill is None:
            try:
                os.makedirs(os.path.dirname(self.spill_path), exist_ok=True)
                self.spill = open(self.spill_path, "wb")
                self.spill.write(self.head)
            except OSError:
                self.spill = False
            keep = self.head[self.cap // 2 :]
            del self.head[self.cap // 2 :]
            self._push_tail(bytes(keep))
        if self.spill:
            with contextlib.suppress(OSError):
                self.spill.write(data)
        self._push_tail(data)

    def _push_tail(self, data: bytes) -> None:
        if not data:
            return
        self.tail.append(data)
        self.tail_bytes += len(data)
        limit = self.cap // 2
        while self.tail_bytes - len(self.tail[0]) >= limit:
            self.tail_bytes -= len(self.tail.popleft())

    def close(self) -> None:
        if self.spill:
            with contextlib.suppress(OSError):
                self.spill.close()

    def shape(self, suffix: str = "") -> dict[str, Any]:
        """The result fields: UTF-8 text, truncation marker and flags."""
        self.close()
        truncated = self.spill is not None
        if not truncated:
            text, replaced = decode_utf8(bytes(self.head), cut_start=False, cut_end=False)
        else:
            tail = b"".join(self.tail)[-(self.cap // 2) :]
            head_text, head_replaced = decode_utf8(bytes(self.head), cut_start=False, cut_end=True)
            tail_text, tail_replaced = decode_utf8(tail, cut_start=True, cut_end=False)
            where = self.spill_path if self.spill else "(could not be saved)"
            marker = (
                f"\n[... output truncated: {self.total} bytes in total, "
                f"{self.total - len(self.head) - len(tail)} bytes omitted here; "
                f"the whole output is in {where} ...]\n"
            )
            text = head_text + marker + tail_text
            replaced = head_replaced or tail_replaced
        return {
            "output": text + suffix,
            "output_truncated": truncated,
            "full_output_bytes": self.total,
            "full_output_path": self.spill_path if truncated and self.spill else "",
            "invalid_utf8_replaced": replaced,
        }


def decode_utf8(data: bytes, *, cut_start: bool, cut_end: bool) -> tuple[str, bool]:
    """Decodes, replacing invalid bytes; a character split by truncation is dropped rather
    than reported as invalid."""
    if cut_start:
        skip = 0
        while skip < min(3, len(data)) and (data[skip] & 0xC0) == 0x80:
            skip += 1
        data = data[skip:]
    try:
        if cut_end:
            decoder = codecs.getincrementaldecoder("utf-8")("strict")
            return decoder.decode(data, final=False), False
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        if cut_end:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            return decoder.decode(data, final=False), True
        return data.decode("utf-8", errors="replace"), True


# --------------------------------------------------------------------------- executions


class Execution:
    def __init__(self, execution_id: str, name: str) -> None:
        self.id = execution_id
        self.name = name
        self.events: list[dict[str, Any]] = []
        self.replay_bytes = 0
        self.replay_full = False
        self.offset = 0
        self.listeners: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self.result: dict[str, Any] | None = None
        self.finished_at = 0.0
        self.done = asyncio.Event()
        self.replay_file = ""

    def replay(self) -> list[dict[str, Any]]:
        """The output events kept for re-attaching, from memory or from their spill file."""
        if not self.replay_file:
            return list(self.events)
        try:
            with open(self.replay_file, "rb") as handle:
                return [json.loads(line) for line in handle]
        except (OSError, ValueError):
            return []

    def spill_replay(self, path: str) -> None:
        """Moves a finished execution's replay buffer to disk, so that records kept for an
        hour do not hold the sandbox's memory; small buffers stay in memory."""
        if self.replay_bytes <= REPLAY_IN_MEMORY_BYTES:
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as handle:
                handle.writelines(encode(event) for event in self.events)
        except OSError:
            return  # kept in memory then
        self.replay_file = path
        self.events = []

    def forget(self) -> None:
        if self.replay_file:
            with contextlib.suppress(OSError):
                os.unlink(self.replay_file)

    def emit_output(self, stream: str, data: bytes) -> None:
        event = {
            "ev": "out",
            "stream": stream,
            "offset": self.offset,
            "data": base64.b64encode(data).decode("ascii"),
        }
        self.offset += len(data)
        # The replay buffer keeps a prefix of the output: past it, output goes to live
        # listeners only (a re-attach sees the prefix, then live chunks at later offsets).
        if not self.replay_full and self.replay_bytes + len(data) <= STREAM_REPLAY_BYTES:
            self.events.append(event)
            self.replay_bytes += len(data)
        else:
            self.replay_full = True
        for queue in self.listeners:
            queue.put_nowait(event)

    def finish(self, result: dict[str, Any]) -> None:
        result["execution_id"] = self.id
        self.result = result
        self.finished_at = time.monotonic()
        event = {"ev": "exited", "result": result}
        for queue in self.listeners:
            queue.put_nowait(event)
            queue.put_nowait(None)
        self.done.set()


class Executor:
    def __init__(self, workspace: str, socket_path: str, max_output: int) -> None:
        self.ws = Workspace(workspace)
        self.max_output = max_output
        self.socket_path = socket_path
        self.executions: dict[str, Execution] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.warm_shells: collections.deque[subprocess.Popen[bytes]] = collections.deque()
        self.refilling = False
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": self.ws.root,
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "USER": os.environ.get("USER", "sandbox"),
            "TMPDIR": "/tmp",
        }

    # ---- connection handling

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serves requests one after another on a connection until the client closes it; an
        error answer closes the connection (its state is then unknown)."""
        handlers: dict[str, Callable[..., Any]] = {
            "ping": self.op_ping,
            "exec": self.op_exec,
            "put_file": self.op_put_file,
            "get_file": self.op_get_file,
            "untar": self.op_untar,
        }
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                request = json.loads(line)
                op = request.get("op")
                handler = handlers.get(op)
                if handler is None:
                    raise RequestError("INVALID_FIELD", f"unknown executor operation {op!r}")
                await handler(request, reader, writer)
        except RequestError as error:
            await send(writer, {"ev": "error", "reason": error.reason, "message": error.message})
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception as error:  # the executor must outlive any one bad request
            with contextlib.suppress(Exception):
                await send(
                    writer,
                    {
                        "ev": "error",
                        "reason": "INTERNAL",
                        "message": f"executor: {type(error).__name__}: {error}",
                    },
                )
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def op_ping(self, request: dict[str, Any], reader: Any, writer: Any) -> None:
        await send(writer, {"ev": "pong", "pid": os.getpid(), "workspace": self.ws.root})

    async def op_exec(
        self, request: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        execution_id = str(request.get("id") or "")
        want_output = bool(request.get("events", True))
        execution = self.executions.get(execution_id) if execution_id else None
        reattached = execution is not None
        if execution is None:
            if request.get("reattach_only"):
                raise RequestError(
                    "EXECUTION_NOT_FOUND",
                    f"no execution {execution_id!r} is known in this sandbox "
                    f"(records are kept {RECORD_SECONDS} s after the end)",
                )
            name = request.get("tool")
            if name not in TOOLS:
                raise RequestError(
                    "UNKNOWN_TOOL", f"unknown tool {name!r}; tools are {', '.join(TOOLS)}"
                )
            tool_input = request.get("input")
            if not isinstance(tool_input, dict):
                raise RequestError("INVALID_TOOL_INPUT", "the tool input must be a JSON object")
            run = self.prepare(name, tool_input, request)
            if not execution_id:
                execution_id = "ex-" + os.urandom(12).hex()
            execution = Execution(execution_id, name)
            self.executions[execution_id] = execution
            task = asyncio.ensure_future(self.run_execution(execution, run))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        # Snapshot and subscribe in one step (no await between), so nothing is lost or doubled.
        replay = execution.replay() if want_output else []
        result = execution.result
        if result is None:
            if want_output:
                execution.listeners.add(queue)
        try:
            await send(
                writer,
                {
                    "ev": "started",
                    "id": execution.id,
                    "name": execution.name,
                    "reattached": reattached,
                },
                flush=want_output,
            )
            for event in replay:
                writer.write(encode(event))
            if result is not None:
                await send(writer, {"ev": "exited", "result": result})
                return
            if not want_output:
                await execution.done.wait()
                assert execution.result is not None
                await send(writer, {"ev": "exited", "result": execution.result})
                return
            await writer.drain()
            while True:
                item = await queue.get()
                if item is None:
                    break
                writer.write(encode(item))
                if queue.empty():
                    await writer.drain()
            await writer.drain()
        finally:
            execution.listeners.discard(queue)

    # ---- tools

    def prepare(
        self, name: str, tool_input: dict[str, Any], request: dict[str, Any]
    ) -> Callable[[Execution, OutputCollector], Any]:
        """Validates the input (raising RequestError) and returns the coroutine to run."""
        timeout_ms = request.get("timeout_ms") or 0
        if name == "bash":
            command = tool_input.get("command")
            if not isinstance(command, str) or not command.strip():
                raise RequestError("INVALID_TOOL_INPUT", "`command` must be a non-empty string")
            if "\x00" in command:
                raise RequestError("INVALID_TOOL_INPUT", "`command` contains a NUL character")
            if not timeout_ms:
                timeout_ms = tool_input.get("timeout_ms") or DEFAULT_TIMEOUT_MS
            if not isinstance(timeout_ms, int) or timeout_ms <= 0:
                raise RequestError("INVALID_TOOL_INPUT", "`timeout_ms` must be a positive integer")
            timeout = min(timeout_ms, MAX_TIMEOUT_MS) / 1000
            return lambda ex, out: self.run_bash(ex, out, command, timeout)
        if name == "read":
            path = self.ws.resolve(tool_input.get("path"))
            offset = _int_field(tool_input, "offset", 1, minimum=1)
            limit = _int_field(tool_input, "limit", READ_DEFAULT_LIMIT, minimum=1)
            return self.in_thread(lambda: tool_read(self.ws, path, offset, limit))
        if name == "write":
            path = self.ws.resolve(tool_input.get("path"))
            content = tool_input.get("content")
            if not isinstance(content, str):
                raise RequestError("INVALID_TOOL_INPUT", "`content` must be a string")
            return self.in_thread(lambda: tool_write(self.ws, path, content))
        if name == "edit":
            path = self.ws.resolve(tool_input.get("path"))
            old, new = tool_input.get("old_string"), tool_input.get("new_string")
            if not isinstance(old, str) or not old:
                raise RequestError("INVALID_TOOL_INPUT", "`old_string` must be a non-empty string")
            if not isinstance(new, str):
                raise RequestError("INVALID_TOOL_INPUT", "`new_string` must be a string")
            replace_all = bool(tool_input.get("replace_all", False))
            return self.in_thread(lambda: tool_edit(self.ws, path, old, new, replace_all))
        if name == "glob":
            pattern = tool_input.get("pattern")
            if not isinstance(pattern, str) or not pattern:
                raise RequestError("INVALID_TOOL_INPUT", "`pattern` must be a non-empty string")
            base = self.ws.resolve(tool_input.get("path") or ".")
            glob_pattern: str = pattern
            return self.in_thread(lambda: tool_glob(self.ws, base, glob_pattern))
        pattern = tool_input.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise RequestError("INVALID_TOOL_INPUT", "`pattern` must be a non-empty string")
        base = self.ws.resolve(tool_input.get("path") or ".")
        file_glob = tool_input.get("glob")
        if file_glob is not None and not isinstance(file_glob, str):
            raise RequestError("INVALID_TOOL_INPUT", "`glob` must be a string")
        argv = ["grep", "-r", "-n", "-E", "-I", "--exclude-dir=.oma", "--color=never"]
        if tool_input.get("ignore_case"):
            argv.append("-i")
        if tool_input.get("files_with_matches"):
            argv.append("-l")
        if file_glob:
            argv.append(f"--include={file_glob}")
        argv += ["-e", pattern]
        if base != self.ws.root:  # without an operand grep prints paths without "./"
            argv += ["--", os.path.relpath(base, self.ws.root)]
        return lambda ex, out: self.run_grep(ex, out, argv)

    def in_thread(self, work: Callable[[], str]) -> Callable[[Execution, OutputCollector], Any]:
        async def run(execution: Execution, out: OutputCollector) -> dict[str, Any]:
            try:
                text = await asyncio.to_thread(work)
                is_error = False
            except ToolFailure as failure:
                text, is_error = str(failure), True
            except OSError as error:
                text, is_error = f"{error.strerror or error}: {error.filename or ''}".strip(), True
            data = text.encode("utf-8", errors="surrogateescape")
            out.add(data)
            execution.emit_output("stdout", data)
            return {"is_error": is_error, "exit_code": 1 if is_error else 0, "timed_out": False}

        return run

    async def run_execution(
        self, execution: Execution, run: Callable[[Execution, OutputCollector], Any]
    ) -> None:
        started = time.monotonic()
        spill = os.path.join(self.ws.root, OUTPUT_DIR_NAME, f"{execution.id}.log")
        out = OutputCollector(self.max_output, spill)
        suffix = ""
        try:
            fields = await run(execution, out)
            suffix = fields.pop("suffix", "")
        except Exception as error:  # e.g. fork refused under the pids limit
            fields = {"is_error": True, "exit_code": 126, "timed_out": False}
            suffix = f"[the tool could not run: {type(error).__name__}: {error}]"
        result = {**fields, **out.shape(suffix)}
        result["duration_ms"] = int((time.monotonic() - started) * 1000)
        execution.finish(result)
        execution.spill_replay(
            os.path.join(self.ws.root, OUTPUT_DIR_NAME, f"{execution.id}.replay")
        )

    async def run_bash(
        self, execution: Execution, out: OutputCollector, command: str, timeout: float
    ) -> dict[str, Any]:
        encoded = command.encode("utf-8", errors="surrogatepass")
        if len(encoded) > WARM_COMMAND_MAX:
            return await self.run_process(
                execution, out, self.spawn(["/bin/bash", "-c", command]), timeout
            )
        proc = self.take_warm_shell()
        assert proc.stdin is not None
        try:
            # The shell waits in `source /dev/stdin`; it runs the command once stdin closes.
            proc.stdin.write(encoded)
            proc.stdin.close()
        except OSError:
            proc.kill()
            proc.wait()
            proc = self.spawn(["/bin/bash", "-c", command])
        try:
            return await self.run_process(execution, out, proc, timeout)
        finally:
            # Started once the call is over, so that it never competes with the call for CPU.
            self.refill_warm_shells()

    def spawn(self, argv: list[str], stdin: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self.ws.root,
            env=self.env,
            start_new_session=True,
        )

    def take_warm_shell(self) -> subprocess.Popen[bytes]:
        """A fresh, never used `bash` in its own session, started ahead of the call so that
        the call does not wait for fork, exec and bash's start-up. Two are kept, so that the
        one taken has had a whole call's time to finish starting."""
        while self.warm_shells:
            proc = self.warm_shells.popleft()
            if proc.poll() is None:
                return proc
            self._close_pipes(proc)
        return self.spawn(WARM_SHELL, stdin=subprocess.PIPE)

    def refill_warm_shells(self) -> None:
        if self.refilling:
            return
        self.refilling = True

        async def refill() -> None:
            try:
                while len(self.warm_shells) < WARM_SHELLS:
                    shell = await asyncio.to_thread(self.spawn, WARM_SHELL, subprocess.PIPE)
                    self.warm_shells.append(shell)
            except Exception:
                pass  # e.g. the pids limit is reached: a call then spawns its own shell
            finally:
                self.refilling = False

        task = asyncio.ensure_future(refill())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    @staticmethod
    def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    async def run_grep(
        self, execution: Execution, out: OutputCollector, argv: list[str]
    ) -> dict[str, Any]:
        fields = await self.run_process(execution, out, self.spawn(argv), MAX_TIMEOUT_MS / 1000)
        if fields["exit_code"] == 1 and out.total == 0:
            # grep's "no match" is an answer, not a failure.
            fields.update(is_error=False, exit_code=0, suffix="No matches found.")
        elif fields["exit_code"] not in (0, 1):
            fields["exit_code"] = 1  # the contract's failure code for tools other than bash
        return fields

    async def run_process(
        self,
        execution: Execution,
        out: OutputCollector,
        proc: subprocess.Popen[bytes],
        timeout: float,
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        # Plain Popen plus loop readers rather than asyncio's subprocess transport: the call
        # must end when its process exits, even while a leftover child still holds a pipe.
        assert proc.stdout is not None and proc.stderr is not None
        open_pipes: dict[int, asyncio.Future[None]] = {}

        def watch(fd: int, name: str) -> None:
            os.set_blocking(fd, False)
            closed: asyncio.Future[None] = loop.create_future()
            open_pipes[fd] = closed

            def readable() -> None:
                try:
                    data = os.read(fd, CHUNK)
                except BlockingIOError:
                    return
                except OSError:
                    data = b""
                if not data:
                    loop.remove_reader(fd)
                    if not closed.done():
                        closed.set_result(None)
                    return
                out.add(data)
                execution.emit_output(name, data)

            loop.add_reader(fd, readable)

        watch(proc.stdout.fileno(), "stdout")
        watch(proc.stderr.fileno(), "stderr")
        exited = await_exit(loop, proc)
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(exited), timeout)
        except TimeoutError:
            timed_out = True
        # The call's processes die with it, whether it ended or timed out: background jobs
        # would otherwise hold the output pipes open and outlive the call.
        await kill_group(proc.pid)
        await exited
        await asyncio.wait(list(open_pipes.values()), timeout=2)
        for fd in open_pipes:  # a process that escaped the group may still hold a pipe
            loop.remove_reader(fd)
        proc.stdout.close()
        proc.stderr.close()
        code = proc.returncode if proc.returncode is not None else -9
        exit_code = 128 - code if code < 0 else code
        suffix = ""
        if timed_out:
            suffix = (
                f"\n[timed out after {timeout * 1000:.0f} ms: the command's process group "
                "was killed]"
            )
        return {
            "is_error": timed_out or exit_code != 0,
            "exit_code": exit_code,
            "timed_out": timed_out,
            "suffix": suffix,
        }

    # ---- files

    async def op_put_file(
        self, request: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        path = self.ws.resolve(request.get("path"))
        limit = int(request.get("max_bytes") or 0)
        mode = int(request.get("mode") or 0o644) & 0o7777
        if os.path.isdir(path):
            raise RequestError("INVALID_FIELD", f"{request.get('path')!r} is a directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=".oma-upload-", dir=os.path.dirname(path))
        # The client sends the content only once the path is accepted.
        await send(writer, {"ev": "ready"})
        digest = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as handle:
                while True:
                    chunk = await read_frame(reader)
                    if chunk is None:
                        break
                    size += len(chunk)
                    if limit and size > limit:
                        raise RequestError(
                            "FILE_TOO_LARGE", f"the file is larger than the limit of {limit} bytes"
                        )
                    digest.update(chunk)
                    handle.write(chunk)
            os.chmod(temp, mode)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        await send(writer, {"ev": "ok", "path": path, "size": size, "sha256": digest.hexdigest()})

    async def op_get_file(
        self, request: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        path = self.ws.resolve(request.get("path"))
        limit = int(request.get("max_bytes") or 0)
        if not os.path.isfile(path):
            raise RequestError(
                "FILE_NOT_FOUND", f"no regular file at {request.get('path')!r} in the workspace"
            )
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if limit and size > limit:
                raise RequestError(
                    "FILE_TOO_LARGE", f"the file has {size} bytes, more than the limit of {limit}"
                )
            await send(writer, {"ev": "ok", "size": size})
            while True:
                chunk = handle.read(CHUNK * 4)
                if not chunk:
                    break
                writer.write(FRAME.pack(len(chunk)) + chunk)
                await writer.drain()
        writer.write(FRAME.pack(0))
        await writer.drain()

    async def op_untar(
        self, request: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        dest = self.ws.resolve(request.get("path"))
        if os.path.lexists(dest):
            raise RequestError("INVALID_FIELD", f"{request.get('path')!r} already exists")
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=".oma-untar-", dir=parent)
        await send(writer, {"ev": "ready"})
        try:
            with os.fdopen(fd, "wb") as handle:
                while (chunk := await read_frame(reader)) is not None:
                    handle.write(chunk)
            staging = tempfile.mkdtemp(prefix=".oma-tree-", dir=parent)
            with tarfile.open(temp) as archive:
                # The sandbox is the boundary (this runs as the sandbox user, inside it), so
                # a repository's own symbolic links are kept as they are; the "tar" filter
                # still drops absolute names and set-id bits where Python has it.
                if hasattr(tarfile, "tar_filter"):
                    archive.extractall(staging, filter="tar")
                else:
                    archive.extractall(staging)
            os.rename(staging, dest)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temp)
        await send(writer, {"ev": "ok", "path": dest})

    # ---- housekeeping

    async def forget_old_records(self) -> None:
        while True:
            await asyncio.sleep(60)
            horizon = time.monotonic() - RECORD_SECONDS
            for key in [
                k
                for k, e in self.executions.items()
                if e.result is not None and e.finished_at < horizon
            ]:
                self.executions.pop(key).forget()


def _int_field(tool_input: dict[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = tool_input.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RequestError("INVALID_TOOL_INPUT", f"`{key}` must be an integer >= {minimum}")
    return value


def tool_read(ws: Workspace, path: str, offset: int, limit: int) -> str:
    if not os.path.exists(path):
        raise ToolFailure(f"File does not exist: {ws.relative(path)}")
    if os.path.isdir(path):
        raise ToolFailure(f"{ws.relative(path)} is a directory; use glob or bash `ls` to list it")
    with open(path, "rb") as handle:
        raw = handle.read()
    if b"\x00" in raw[:8192]:
        raise ToolFailure(
            f"{ws.relative(path)} is a binary file ({len(raw)} bytes); use DownloadFile to fetch it"
        )
    lines = raw.decode("utf-8", errors="surrogateescape").splitlines()  # flagged later
    if not lines:
        return f"({ws.relative(path)} is empty)"
    if offset > len(lines):
        raise ToolFailure(
            f"offset {offset} is past the end of {ws.relative(path)} ({len(lines)} lines)"
        )
    chosen = lines[offset - 1 : offset - 1 + limit]
    numbered = []
    for number, line in enumerate(chosen, start=offset):
        if len(line) > READ_MAX_LINE_CHARS:
            line = line[:READ_MAX_LINE_CHARS] + " [line truncated]"
        numbered.append(f"{number}\t{line}")
    return "\n".join(numbered)


def tool_write(ws: Workspace, path: str, content: str) -> str:
    if os.path.isdir(path):
        raise ToolFailure(f"{ws.relative(path)} is a directory")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = content.encode("utf-8", errors="surrogatepass")
    with open(path, "wb") as handle:
        handle.write(data)
    return f"Wrote {len(data)} bytes to {ws.relative(path)}"


def tool_edit(ws: Workspace, path: str, old: str, new: str, replace_all: bool) -> str:
    if not os.path.isfile(path):
        raise ToolFailure(f"File does not exist: {ws.relative(path)}")
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as handle:
        text = handle.read()
    count = text.count(old)
    if count == 0:
        raise ToolFailure(
            f"old_string was not found in {ws.relative(path)}; the file is "
            "unchanged (read it again and copy the exact text)"
        )
    if count > 1 and not replace_all:
        raise ToolFailure(
            f"old_string occurs {count} times in {ws.relative(path)}; the file "
            "is unchanged (give more context to make it unique, or set "
            "replace_all)"
        )
    text = text.replace(old, new) if replace_all else text.replace(old, new, 1)
    with open(path, "w", encoding="utf-8", errors="surrogateescape", newline="") as handle:
        handle.write(text)
    return f"Replaced {count if replace_all else 1} occurrence(s) in {ws.relative(path)}"


def tool_glob(ws: Workspace, base: str, pattern: str) -> str:
    if not os.path.isdir(base):
        raise ToolFailure(f"{ws.relative(base)} is not a directory")
    regex = re.compile(glob_to_regex(pattern))
    found: list[tuple[float, str]] = []
    for directory, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in (".oma", ".git")]
        for name in files:
            full = os.path.join(directory, name)
            if regex.fullmatch(os.path.relpath(full, base)):
                with contextlib.suppress(OSError):
                    found.append((os.lstat(full).st_mtime, ws.relative(full)))
    if not found:
        return "No files found."
    found.sort(key=lambda item: (-item[0], item[1]))
    return "\n".join(path for _, path in found)


def glob_to_regex(pattern: str) -> str:
    """`**/` matches any number of directories, `*` and `?` stay within one."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


# --------------------------------------------------------------------------- plumbing


def await_exit(
    loop: asyncio.AbstractEventLoop, proc: subprocess.Popen[bytes]
) -> asyncio.Future[None]:
    """A future done once `proc` exited (and was reaped), from a pidfd where the kernel has
    them, else by polling."""
    done: asyncio.Future[None] = loop.create_future()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = -1

    def check() -> None:
        if proc.poll() is not None and not done.done():
            if pidfd >= 0:
                loop.remove_reader(pidfd)
                os.close(pidfd)
            done.set_result(None)

    if pidfd >= 0:
        loop.add_reader(pidfd, check)
        check()
    else:

        async def poll() -> None:
            while not done.done():
                check()
                await asyncio.sleep(0.005)

        poller = asyncio.ensure_future(poll())
        done.add_done_callback(lambda _: poller.cancel())
    return done


async def kill_group(pgid: int) -> None:
    """Kills every process of a group, again while a fork bomb keeps adding members."""
    for _ in range(50):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        await asyncio.sleep(0.005)


def encode(event: dict[str, Any]) -> bytes:
    return (json.dumps(event, separators=(",", ":")) + "\n").encode()


async def send(writer: asyncio.StreamWriter, event: dict[str, Any], flush: bool = True) -> None:
    writer.write(encode(event))
    if flush:
        await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    header = await reader.readexactly(FRAME.size)
    (length,) = FRAME.unpack(header)
    if length == 0:
        return None
    return await reader.readexactly(length)


async def main_async(args: argparse.Namespace) -> None:
    executor = Executor(args.workspace, args.socket, args.max_output)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    temp_socket = args.socket + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temp_socket)
    server = await asyncio.start_unix_server(executor.handle, path=temp_socket, limit=1 << 24)
    os.chmod(temp_socket, 0o666)  # the directory holding it is the gate
    # Appearing under its final name only once listening, so a client polling for the
    # socket never connects too early.
    os.rename(temp_socket, args.socket)
    housekeeping = asyncio.ensure_future(executor.forget_old_records())
    executor.refill_warm_shells()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()
    housekeeping.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description="OMA in-sandbox executor")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--workspace", default="/workspace")
    parser.add_argument("--max-output", type=int, default=DEFAULT_MAX_OUTPUT)
    args = parser.parse_args()
    os.umask(0o022)
    try:
        asyncio.run(main_async(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
