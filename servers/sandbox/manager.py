"""The sandbox service's core, independent of gRPC and of the backend.

`SandboxManager` keeps the record of every sandbox, makes `Provision` idempotent by request id,
runs init steps apart from creating the sandbox (so a warm pool could serve `Provision`), turns
a dead backend resource into `SANDBOX_TERMINATED`, and destroys sandboxes whose lifetime or
idle timeout has passed. Tool calls go straight to the sandbox's executor, which holds the
execution records (so a repeated execution id never runs twice, even across a server restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import tarfile
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from oma.servers.sandbox.backends.base import Backend
from oma.servers.sandbox.git import PublicRepositoryFetcher, RepositoryFetcher
from oma.servers.sandbox.model import (
    RESERVED_LABEL_PREFIX,
    SESSION_LABEL,
    WORKSPACE,
    ExecutionResult,
    Limits,
    Sandbox,
    SandboxError,
    SandboxSpec,
    SandboxState,
    StreamEvent,
)
from oma.servers.sandbox.protocol import ExecutorClient, ExecutorUnreachable

log = logging.getLogger("oma.sandbox")

ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
REAPER_INTERVAL_SECONDS = 5.0


def _check_id(value: str, field: str) -> None:
    if not ID_PATTERN.fullmatch(value):
        raise SandboxError(
            "INVALID_FIELD",
            f"{field} must be 1-128 characters of [A-Za-z0-9._-], got {value!r}",
            {"field": field},
        )


def workspace_relative(path: str, field: str) -> str:
    """A lexical check of an init path; the executor re-checks against symbolic links."""
    if not path or "\x00" in path:
        raise SandboxError("INVALID_FIELD", f"{field} must be a non-empty path", {"field": field})
    pure = PurePosixPath(path)
    if pure.is_absolute():
        try:
            pure = pure.relative_to(WORKSPACE)
        except ValueError:
            raise SandboxError(
                "PATH_OUTSIDE_WORKSPACE", f"{field} {path!r} is outside {WORKSPACE}"
            ) from None
    if ".." in pure.parts or str(pure) in ("", "."):
        raise SandboxError(
            "PATH_OUTSIDE_WORKSPACE", f"{field} {path!r} must name a path inside {WORKSPACE}"
        )
    return str(pure)


class SandboxManager:
    def __init__(
        self,
        backend: Backend,
        *,
        limits: Limits | None = None,
        fetcher: RepositoryFetcher | None = None,
        reaper_interval: float = REAPER_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.limits = limits or Limits()
        self.fetcher: RepositoryFetcher = fetcher or PublicRepositoryFetcher()
        self.reaper_interval = reaper_interval
        self.clock = clock
        self.records: dict[str, Sandbox] = {}
        self.by_request: dict[str, str] = {}
        self.in_flight: dict[str, asyncio.Future[Sandbox]] = {}
        self.last_used: dict[str, float] = {}
        self.clients: dict[str, ExecutorClient] = {}
        self._destroying: dict[str, asyncio.Future[None]] = {}
        # Calls in progress per sandbox: a sandbox running a long tool call is not idle.
        self.busy: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None

    @property
    def features(self) -> frozenset[str]:
        return self.backend.features | {
            "sandbox.execute_stream",
            "sandbox.git_clone",
            "sandbox.file_transfer",
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        for sandbox in await self.backend.recover():
            self.records[sandbox.id] = sandbox
            self.last_used[sandbox.id] = self.clock()
            if sandbox.request_id:
                self.by_request[sandbox.request_id] = sandbox.id
        if self.records:
            log.info("recovered %d live sandboxes", len(self.records))
        self._reaper = asyncio.create_task(self._reap_forever())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.backend.close()

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reaper_interval)
            try:
                await self.reap()
            except Exception:
                log.exception("reaping sandboxes failed")

    async def reap(self) -> None:
        """Destroys expired and idle sandboxes, notices dead ones, forgets old records."""
        now = self.clock()
        for sandbox in list(self.records.values()):
            if sandbox.state is SandboxState.READY:
                idle = self.busy.get(sandbox.id, 0) == 0 and (
                    now - self.last_used.get(sandbox.id, now)
                    >= sandbox.resources.idle_timeout_seconds
                )
                if now >= sandbox.expire_time:
                    await self._terminate(
                        sandbox.id, f"lifetime of {sandbox.resources.lifetime_seconds:.0f} s ended"
                    )
                elif idle:
                    await self._terminate(
                        sandbox.id,
                        f"idle for {sandbox.resources.idle_timeout_seconds:.0f} s "
                        "(no RPC named it)",
                    )
                else:
                    await self._check_alive(sandbox.id)
            elif (
                sandbox.state is SandboxState.TERMINATED
                and now - sandbox.terminate_time >= self.limits.terminated_record_seconds
            ):
                self.records.pop(sandbox.id, None)
                self.last_used.pop(sandbox.id, None)
                if self.by_request.get(sandbox.request_id) == sandbox.id:
                    del self.by_request[sandbox.request_id]

    async def _terminate(self, sandbox_id: str, reason: str) -> Sandbox | None:
        sandbox = self.records.get(sandbox_id)
        if sandbox is None:
            return None
        if sandbox.state is not SandboxState.TERMINATED:
            sandbox.state = SandboxState.TERMINATED
            sandbox.terminate_time = self.clock()
            sandbox.terminate_reason = reason
            log.info("sandbox %s terminated: %s", sandbox_id, reason)
        client = self.clients.pop(sandbox_id, None)
        if client is not None:
            client.close()
        # Concurrent terminations (reaper, DestroySandbox, a failed Execute) share one destroy.
        destroying = self._destroying.get(sandbox_id)
        if destroying is None:
            destroying = asyncio.ensure_future(self.backend.destroy(sandbox_id))
            self._destroying[sandbox_id] = destroying
            destroying.add_done_callback(lambda _: self._destroying.pop(sandbox_id, None))
        await asyncio.shield(destroying)
        return sandbox

    async def _check_alive(self, sandbox_id: str) -> bool:
        reason = await self.backend.death_reason(sandbox_id)
        if reason is None:
            return True
        await self._terminate(sandbox_id, reason)
        return False

    # ------------------------------------------------------------------ provisioning

    def validate(self, spec: SandboxSpec) -> SandboxSpec:
        for key, value in spec.labels.items():
            if not 1 <= len(key) <= 128 or len(value) > 256:
                raise SandboxError(
                    "INVALID_FIELD",
                    f"label {key!r}: keys are 1-128 characters, values at most 256",
                    {"field": "labels"},
                )
            if key.startswith(RESERVED_LABEL_PREFIX) and key != SESSION_LABEL:
                raise SandboxError(
                    "INVALID_FIELD",
                    f"label {key!r}: keys starting with {RESERVED_LABEL_PREFIX} are reserved "
                    f"(only {SESSION_LABEL} may be set)",
                    {"field": "labels"},
                )
        self.limits.check(spec.resources)
        if spec.network_allow_list and "sandbox.network_allow_list" not in self.features:
            raise SandboxError(
                "FEATURE_NOT_SUPPORTED",
                "this sandbox server cannot restrict network access to an allow-list; "
                "provision with NETWORK_MODE_NONE",
            )
        for index, repo in enumerate(spec.repositories):
            if not repo.url:
                raise SandboxError(
                    "INVALID_FIELD",
                    f"init.repositories[{index}].url is empty",
                    {"field": f"init.repositories[{index}].url"},
                )
            workspace_relative(
                repo.path or default_clone_dir(repo.url), f"init.repositories[{index}].path"
            )
        for index, file in enumerate(spec.files):
            workspace_relative(file.path, f"init.files[{index}].path")
            if len(file.content) > self.limits.max_file_bytes:
                raise SandboxError(
                    "FILE_TOO_LARGE",
                    f"init.files[{index}] has {len(file.content)} bytes, more than the limit",
                    {"limit": str(self.limits.max_file_bytes)},
                )
        return replace(
            spec,
            resources=spec.resources.with_defaults(self.limits.defaults),
            image=spec.image or self.backend.default_image,
        )

    async def provision(
        self, request_id: str, spec: SandboxSpec, vault_session_token: str = ""
    ) -> Sandbox:
        if request_id:
            _check_id(request_id, "request_id")
        fingerprint = spec.fingerprint()
        spec = self.validate(spec)
        if request_id:
            if request_id in self.in_flight:
                return (await asyncio.shield(self.in_flight[request_id])).copy()
            known = self.records.get(self.by_request.get(request_id, ""))
            if known is not None:
                if known.fingerprint != fingerprint:
                    raise SandboxError(
                        "REQUEST_ID_REUSED",
                        f"request_id {request_id!r} was already used for a different "
                        f"Provision (sandbox {known.id}); use a new request id",
                    )
                return known.copy()
        future: asyncio.Future[Sandbox] = asyncio.get_running_loop().create_future()
        if request_id:
            self.in_flight[request_id] = future
        try:
            sandbox = await self._provision(request_id, fingerprint, spec, vault_session_token)
            future.set_result(sandbox)
            return sandbox.copy()
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved here, so an unshared future logs no warning
            raise
        finally:
            if request_id:
                self.in_flight.pop(request_id, None)

    async def _provision(
        self, request_id: str, fingerprint: str, spec: SandboxSpec, vault_session_token: str
    ) -> Sandbox:
        now = self.clock()
        sandbox = Sandbox(
            id="sb-" + uuid.uuid4().hex[:24],
            labels=dict(spec.labels),
            state=SandboxState.PROVISIONING,
            backend=self.backend.name,
            resources=spec.resources,
            image=spec.image,
            allowed_hosts=spec.allowed_hosts,
            network_allow_list=spec.network_allow_list,
            create_time=now,
            expire_time=now + spec.resources.lifetime_seconds,
            request_id=request_id,
            fingerprint=fingerprint,
        )
        self.records[sandbox.id] = sandbox
        self.last_used[sandbox.id] = now
        try:
            socket = await self.backend.create(sandbox, self.limits.max_output_bytes)
            client = self.clients[sandbox.id] = ExecutorClient(socket)
            await self._run_init_steps(sandbox, client, spec, vault_session_token)
            await self.backend.mark_ready(sandbox.id)
        except BaseException as error:
            reason = error.message if isinstance(error, SandboxError) else repr(error)
            await asyncio.shield(self._terminate(sandbox.id, f"provisioning failed: {reason}"))
            raise
        sandbox.state = SandboxState.READY
        if request_id:
            self.by_request[request_id] = sandbox.id
        return sandbox

    async def _run_init_steps(
        self, sandbox: Sandbox, client: ExecutorClient, spec: SandboxSpec, token: str
    ) -> None:
        for index, repo in enumerate(spec.repositories):
            target = workspace_relative(
                repo.path or default_clone_dir(repo.url), f"init.repositories[{index}].path"
            )
            with tempfile.TemporaryDirectory(prefix="oma-clone-") as tmp:
                checkout = Path(tmp) / "checkout"
                try:
                    await self.fetcher.fetch(repo, checkout, token)
                except SandboxError as error:
                    raise SandboxError(
                        "INIT_FAILED", f"init.repositories[{index}]: {error.message}"
                    ) from error
                archive = await asyncio.to_thread(_tar_directory, checkout)
            try:
                await client.untar(target, archive)
            except SandboxError as error:
                raise SandboxError(
                    "INIT_FAILED",
                    f"init.repositories[{index}]: copying into {target} failed: {error.message}",
                ) from error
        for index, file in enumerate(spec.files):
            path = workspace_relative(file.path, f"init.files[{index}].path")

            async def one_chunk(content: bytes = file.content) -> AsyncIterator[bytes]:
                yield content

            try:
                await client.put_file(
                    path, one_chunk(), mode=file.mode or 0o644, max_bytes=self.limits.max_file_bytes
                )
            except SandboxError as error:
                raise SandboxError(
                    "INIT_FAILED", f"init.files[{index}] ({file.path}): {error.message}"
                ) from error

    # ------------------------------------------------------------------ queries

    def _record(self, sandbox_id: str) -> Sandbox:
        sandbox = self.records.get(sandbox_id)
        if sandbox is None:
            raise SandboxError(
                "SANDBOX_NOT_FOUND",
                f"no sandbox {sandbox_id!r} on this server (it may never have existed, or its "
                f"record expired {self.limits.terminated_record_seconds} s after it ended)",
                {"sandbox_id": sandbox_id},
            )
        return sandbox

    async def get(self, sandbox_id: str) -> Sandbox:
        sandbox = self._record(sandbox_id)
        self.last_used[sandbox_id] = self.clock()
        if sandbox.state is SandboxState.READY:
            await self._check_alive(sandbox_id)
        return sandbox.copy()

    def list(self, selector: dict[str, str], include_terminated: bool) -> list[Sandbox]:
        found = [
            s.copy()
            for s in self.records.values()
            if all(s.labels.get(k) == v for k, v in selector.items())
            and (include_terminated or s.state is not SandboxState.TERMINATED)
        ]
        found.sort(key=lambda s: (s.create_time, s.id))
        return found

    async def destroy(self, sandbox_id: str) -> Sandbox | None:
        sandbox = self.records.get(sandbox_id)
        if sandbox is None:
            return None
        if sandbox.state is SandboxState.PROVISIONING and sandbox.request_id in self.in_flight:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.in_flight[sandbox.request_id])
        terminated = await self._terminate(sandbox_id, "destroyed by DestroySandbox")
        return terminated.copy() if terminated else None

    # ------------------------------------------------------------------ execution

    async def _live_client(self, sandbox_id: str) -> ExecutorClient:
        sandbox = self._record(sandbox_id)
        if sandbox.state is SandboxState.PROVISIONING and sandbox.request_id in self.in_flight:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.in_flight[sandbox.request_id])
        if sandbox.state is not SandboxState.READY:
            raise self._terminated_error(sandbox)
        self.last_used[sandbox_id] = self.clock()
        client = self.clients.get(sandbox_id)
        if client is None:
            client = self.clients[sandbox_id] = ExecutorClient(self.backend.socket_path(sandbox_id))
        return client

    def _terminated_error(self, sandbox: Sandbox) -> SandboxError:
        return SandboxError(
            "SANDBOX_TERMINATED",
            f"sandbox {sandbox.id} is terminated ({sandbox.terminate_reason or 'provisioning'}); "
            "provision a new one",
            {"sandbox_id": sandbox.id},
        )

    async def _unreachable(self, sandbox_id: str, error: Exception) -> SandboxError:
        """The executor did not answer: either the sandbox died, or something transient."""
        if not await self._check_alive(sandbox_id):
            return self._terminated_error(self._record(sandbox_id))
        return SandboxError("INTERNAL", f"the sandbox executor did not answer: {error}")

    def _timeout_ms(self, timeout_seconds: float) -> int:
        if timeout_seconds <= 0:
            return 0
        return min(int(timeout_seconds * 1000), self.limits.max_timeout_ms)

    async def execute_stream(
        self,
        sandbox_id: str,
        name: str,
        input_json: str,
        execution_id: str,
        timeout_seconds: float,
        *,
        stream: bool = True,
    ) -> AsyncIterator[StreamEvent]:
        """Runs a tool (or re-attaches to an execution) and yields its events."""
        if execution_id:
            _check_id(execution_id, "execution_id")
        else:
            if not name:
                raise SandboxError(
                    "INVALID_FIELD",
                    "name is required unless execution_id names an execution to re-attach to",
                    {"field": "name"},
                )
            execution_id = "ex-" + uuid.uuid4().hex[:24]
        tool_input: Any = None
        if input_json:
            with contextlib.suppress(ValueError):
                tool_input = json.loads(input_json)
        client = await self._live_client(sandbox_id)
        self.busy[sandbox_id] = self.busy.get(sandbox_id, 0) + 1
        try:
            # The executor decides: a known id re-attaches whatever the name and input; only a
            # new execution validates them (UNKNOWN_TOOL, INVALID_TOOL_INPUT, paths).
            async for event in client.execute(
                execution_id=execution_id,
                tool=name,
                tool_input=tool_input,
                timeout_ms=self._timeout_ms(timeout_seconds),
                stream=stream,
                reattach_only=not name,
            ):
                yield event
        except ExecutorUnreachable as error:
            raise await self._unreachable(sandbox_id, error) from error
        except SandboxError as error:
            if error.reason == "INVALID_TOOL_INPUT" and input_json and tool_input is None:
                raise SandboxError(
                    "INVALID_TOOL_INPUT", f"input_json is not valid JSON: {input_json[:200]!r}"
                ) from error
            raise
        finally:
            self.last_used[sandbox_id] = self.clock()
            self.busy[sandbox_id] -= 1
            if not self.busy[sandbox_id]:
                del self.busy[sandbox_id]

    async def execute(
        self,
        sandbox_id: str,
        name: str,
        input_json: str,
        execution_id: str,
        timeout_seconds: float,
    ) -> ExecutionResult:
        if not name:
            raise SandboxError("INVALID_FIELD", "name (the tool) is required", {"field": "name"})
        result = None
        async for event in self.execute_stream(
            sandbox_id, name, input_json, execution_id, timeout_seconds, stream=False
        ):
            if event.result is not None:
                result = event.result
        if result is None:
            raise SandboxError("INTERNAL", "the executor ended the execution without a result")
        return result

    # ------------------------------------------------------------------ files

    async def upload(
        self, sandbox_id: str, path: str, mode: int, chunks: AsyncIterator[bytes]
    ) -> dict[str, Any]:
        client = await self._live_client(sandbox_id)
        try:
            return await client.put_file(
                path, chunks, mode=mode or 0o644, max_bytes=self.limits.max_file_bytes
            )
        except ExecutorUnreachable as error:
            raise await self._unreachable(sandbox_id, error) from error

    async def download(self, sandbox_id: str, path: str) -> AsyncIterator[tuple[int, bytes]]:
        client = await self._live_client(sandbox_id)
        try:
            async for item in client.get_file(path, max_bytes=self.limits.max_file_bytes):
                yield item
        except ExecutorUnreachable as error:
            raise await self._unreachable(sandbox_id, error) from error
        except SandboxError as error:
            if error.reason == "FILE_TOO_LARGE":
                error.metadata.setdefault("limit", str(self.limits.max_file_bytes))
            raise


def default_clone_dir(url: str) -> str:
    name = url.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return name.removesuffix(".git") or "repository"


def _tar_directory(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(directory, arcname=".")
    return buffer.getvalue()
