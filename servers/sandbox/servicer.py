"""`oma.sandbox.v1.SandboxService` over gRPC: validates requests, calls `SandboxManager`, and
maps domain errors to status codes with `ErrorInfo` reasons."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from oma import __version__
from oma.common.v1 import common_pb2
from oma.runtime.errors import OmaError, invalid_field, require_field
from oma.runtime.server import Service
from oma.sandbox.v1 import sandbox_pb2 as pb
from oma.sandbox.v1 import sandbox_pb2_grpc
from oma.servers.sandbox.manager import SandboxManager
from oma.servers.sandbox.model import (
    ExecutionResult,
    GitRepository,
    InitFile,
    Resources,
    Sandbox,
    SandboxError,
    SandboxSpec,
    SandboxState,
)
from oma.servers.sandbox.tools import TOOLS

SERVICE_NAME = "oma.sandbox.v1.SandboxService"
UPLOAD_CHUNK_LIMIT = 1 << 20
DOWNLOAD_CHUNK = 1 << 20
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100

_CODES: dict[str, grpc.StatusCode] = {
    "SANDBOX_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "EXECUTION_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "FILE_NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "SANDBOX_TERMINATED": grpc.StatusCode.FAILED_PRECONDITION,
    "IMAGE_NOT_FOUND": grpc.StatusCode.FAILED_PRECONDITION,
    "INIT_FAILED": grpc.StatusCode.FAILED_PRECONDITION,
    "UNKNOWN_TOOL": grpc.StatusCode.INVALID_ARGUMENT,
    "INVALID_TOOL_INPUT": grpc.StatusCode.INVALID_ARGUMENT,
    "PATH_OUTSIDE_WORKSPACE": grpc.StatusCode.INVALID_ARGUMENT,
    "INVALID_FIELD": grpc.StatusCode.INVALID_ARGUMENT,
    "INVALID_PAGE_TOKEN": grpc.StatusCode.INVALID_ARGUMENT,
    "RESOURCES_EXCEED_LIMIT": grpc.StatusCode.INVALID_ARGUMENT,
    "REQUEST_ID_REUSED": grpc.StatusCode.ALREADY_EXISTS,
    "FILE_TOO_LARGE": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "FEATURE_NOT_SUPPORTED": grpc.StatusCode.UNIMPLEMENTED,
    "INTERNAL": grpc.StatusCode.INTERNAL,
}


def to_oma_error(error: SandboxError) -> OmaError:
    code = _CODES.get(error.reason, grpc.StatusCode.INTERNAL)
    reason = error.reason if error.reason in _CODES else "INTERNAL"
    return OmaError(code, reason, error.message, error.metadata)


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def _duration(seconds: float) -> duration_pb2.Duration:
    message = duration_pb2.Duration()
    message.FromNanoseconds(int(seconds * 1e9))
    return message


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    message = timestamp_pb2.Timestamp()
    message.FromNanoseconds(int(seconds * 1e9))
    return message


def resources_from_proto(message: pb.Resources) -> Resources:
    return Resources(
        cpu_millis=message.cpu_millis,
        memory_bytes=message.memory_bytes,
        disk_bytes=message.disk_bytes,
        pids=message.pids,
        lifetime_seconds=_seconds(message.lifetime),
        idle_timeout_seconds=_seconds(message.idle_timeout),
    )


def resources_to_proto(resources: Resources) -> pb.Resources:
    return pb.Resources(
        cpu_millis=resources.cpu_millis,
        memory_bytes=resources.memory_bytes,
        disk_bytes=resources.disk_bytes,
        pids=resources.pids,
        lifetime=_duration(resources.lifetime_seconds),
        idle_timeout=_duration(resources.idle_timeout_seconds),
    )


_STATES = {
    SandboxState.PROVISIONING: pb.SANDBOX_STATE_PROVISIONING,
    SandboxState.READY: pb.SANDBOX_STATE_READY,
    SandboxState.TERMINATED: pb.SANDBOX_STATE_TERMINATED,
}


def sandbox_to_proto(sandbox: Sandbox) -> pb.Sandbox:
    message = pb.Sandbox(
        id=sandbox.id,
        labels=sandbox.labels,
        state=_STATES[sandbox.state],
        backend=sandbox.backend,
        resources=resources_to_proto(sandbox.resources),
        image=sandbox.image,
        network=pb.NetworkPolicy(
            mode=pb.NETWORK_MODE_ALLOW_LIST if sandbox.network_allow_list else pb.NETWORK_MODE_NONE,
            allowed_hosts=list(sandbox.allowed_hosts),
        ),
        create_time=_timestamp(sandbox.create_time),
        expire_time=_timestamp(sandbox.expire_time),
        terminate_reason=sandbox.terminate_reason,
    )
    if sandbox.state is SandboxState.TERMINATED:
        message.terminate_time.CopyFrom(_timestamp(sandbox.terminate_time))
    return message


def result_to_proto(result: ExecutionResult) -> pb.ExecuteResponse:
    return pb.ExecuteResponse(
        output=result.output,
        is_error=result.is_error,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        output_truncated=result.output_truncated,
        full_output_bytes=result.full_output_bytes,
        full_output_path=result.full_output_path,
        invalid_utf8_replaced=result.invalid_utf8_replaced,
        duration=_duration(result.duration_seconds),
        execution_id=result.execution_id,
    )


def spec_from_request(request: pb.ProvisionRequest) -> SandboxSpec:
    return SandboxSpec(
        labels=dict(request.labels),
        resources=resources_from_proto(request.resources),
        image=request.image,
        allowed_hosts=tuple(request.network.allowed_hosts),
        network_allow_list=request.network.mode == pb.NETWORK_MODE_ALLOW_LIST,
        repositories=tuple(
            GitRepository(url=r.url, ref=r.ref, path=r.path, credential_id=r.credential_id)
            for r in request.init.repositories
        ),
        files=tuple(
            InitFile(path=f.path, content=f.content, mode=f.mode or 0o644)
            for f in request.init.files
        ),
    )


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager

    async def GetCapabilities(
        self, request: pb.GetCapabilitiesRequest, context: Any
    ) -> pb.GetCapabilitiesResponse:
        limits = self.manager.limits
        values = {
            "sandbox.max_output_bytes": limits.max_output_bytes,
            "sandbox.max_file_bytes": limits.max_file_bytes,
            "sandbox.max_timeout_ms": limits.max_timeout_ms,
            "sandbox.default_timeout_ms": limits.default_timeout_ms,
            "sandbox.stream_replay_bytes": limits.stream_replay_bytes,
            "sandbox.execution_record_seconds": limits.execution_record_seconds,
            "sandbox.terminated_record_seconds": limits.terminated_record_seconds,
            "sandbox.max_memory_bytes": limits.maximum.memory_bytes,
            "sandbox.max_cpu_millis": limits.maximum.cpu_millis,
            "sandbox.max_pids": limits.maximum.pids,
            "sandbox.default_lifetime_seconds": int(limits.defaults.lifetime_seconds),
            "sandbox.default_idle_timeout_seconds": int(limits.defaults.idle_timeout_seconds),
        }
        return pb.GetCapabilitiesResponse(
            server_info=common_pb2.ServerInfo(
                implementation="oma-reference",
                version=__version__,
                api_versions=["oma.sandbox.v1"],
                features=sorted(self.manager.features),
                limits=values,
            ),
            backend=self.manager.backend.name,
            tools=[
                pb.ToolSpec(
                    name=t.name, description=t.description, input_schema_json=t.input_schema_json
                )
                for t in TOOLS
            ],
            default_resources=resources_to_proto(limits.defaults),
            default_image=self.manager.backend.default_image,
        )

    async def Provision(self, request: pb.ProvisionRequest, context: Any) -> pb.ProvisionResponse:
        try:
            sandbox = await self.manager.provision(
                request.request_id, spec_from_request(request), request.vault_session_token
            )
        except SandboxError as error:
            raise to_oma_error(error) from None
        return pb.ProvisionResponse(sandbox=sandbox_to_proto(sandbox))

    async def Execute(self, request: pb.ExecuteRequest, context: Any) -> pb.ExecuteResponse:
        require_field(request.sandbox_id, "sandbox_id")
        require_field(request.name, "name")
        try:
            result = await self.manager.execute(
                request.sandbox_id,
                request.name,
                request.input_json,
                request.execution_id,
                _seconds(request.timeout),
            )
        except SandboxError as error:
            raise to_oma_error(error) from None
        return result_to_proto(result)

    async def ExecuteStream(
        self, request: pb.ExecuteStreamRequest, context: Any
    ) -> AsyncIterator[pb.ExecuteStreamResponse]:
        require_field(request.sandbox_id, "sandbox_id")
        if not request.name and not request.execution_id:
            raise invalid_field(
                "name", "is required to start an execution (or execution_id to re-attach)"
            )
        try:
            async for event in self.manager.execute_stream(
                request.sandbox_id,
                request.name,
                request.input_json,
                request.execution_id,
                _seconds(request.timeout),
            ):
                response = pb.ExecuteStreamResponse(execution_id=event.execution_id)
                if event.kind == "started":
                    response.started.CopyFrom(
                        pb.ExecutionStarted(name=event.name, reattached=event.reattached)
                    )
                elif event.kind == "exited" and event.result is not None:
                    response.exited.CopyFrom(result_to_proto(event.result))
                else:
                    chunk = pb.OutputChunk(data=event.data, offset=event.offset)
                    if event.kind == "stderr":
                        response.stderr.CopyFrom(chunk)
                    else:
                        response.stdout.CopyFrom(chunk)
                yield response
        except SandboxError as error:
            raise to_oma_error(error) from None

    async def GetSandbox(
        self, request: pb.GetSandboxRequest, context: Any
    ) -> pb.GetSandboxResponse:
        require_field(request.sandbox_id, "sandbox_id")
        try:
            sandbox = await self.manager.get(request.sandbox_id)
        except SandboxError as error:
            raise to_oma_error(error) from None
        return pb.GetSandboxResponse(sandbox=sandbox_to_proto(sandbox))

    async def ListSandboxes(
        self, request: pb.ListSandboxesRequest, context: Any
    ) -> pb.ListSandboxesResponse:
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        page_size = max(1, min(page_size, MAX_PAGE_SIZE))
        after: tuple[float, str] | None = None
        if request.page_token:
            try:
                decoded = json.loads(base64.urlsafe_b64decode(request.page_token.encode()))
                after = (float(decoded["t"]), str(decoded["id"]))
            except (ValueError, KeyError, TypeError):
                raise OmaError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "INVALID_PAGE_TOKEN",
                    "page_token was not issued by this server; start again without one",
                ) from None
        found = self.manager.list(dict(request.label_selector), request.include_terminated)
        if after is not None:
            found = [s for s in found if (s.create_time, s.id) > after]
        page, rest = found[:page_size], found[page_size:]
        token = ""
        if rest:
            last = page[-1]
            token = base64.urlsafe_b64encode(
                json.dumps({"t": last.create_time, "id": last.id}).encode()
            ).decode()
        return pb.ListSandboxesResponse(
            sandboxes=[sandbox_to_proto(s) for s in page], next_page_token=token
        )

    async def DestroySandbox(
        self, request: pb.DestroySandboxRequest, context: Any
    ) -> pb.DestroySandboxResponse:
        require_field(request.sandbox_id, "sandbox_id")
        sandbox = await self.manager.destroy(request.sandbox_id)
        response = pb.DestroySandboxResponse()
        if sandbox is not None:
            response.sandbox.CopyFrom(sandbox_to_proto(sandbox))
        return response

    async def UploadFile(
        self, request_iterator: AsyncIterator[pb.UploadFileRequest], context: Any
    ) -> pb.UploadFileResponse:
        iterator = request_iterator.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            first = pb.UploadFileRequest()
        if first.WhichOneof("part") != "header":
            raise OmaError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "INVALID_FIELD",
                "the first UploadFile message must carry the header",
                {"field": "header"},
            )
        header = first.header
        require_field(header.sandbox_id, "header.sandbox_id")
        require_field(header.path, "header.path")

        async def chunks() -> AsyncIterator[bytes]:
            async for message in iterator:
                if message.WhichOneof("part") != "chunk":
                    raise SandboxError(
                        "INVALID_FIELD",
                        "only the first UploadFile message may carry a header",
                        {"field": "header"},
                    )
                yield message.chunk

        try:
            written = await self.manager.upload(
                header.sandbox_id, header.path, header.mode, chunks()
            )
        except SandboxError as error:
            raise to_oma_error(error) from None
        return pb.UploadFileResponse(
            path=str(written["path"]),
            size_bytes=int(written["size"]),
            sha256=str(written["sha256"]),
        )

    async def DownloadFile(
        self, request: pb.DownloadFileRequest, context: Any
    ) -> AsyncIterator[pb.DownloadFileResponse]:
        require_field(request.sandbox_id, "sandbox_id")
        require_field(request.path, "path")
        try:
            sent_any = False
            pending = b""
            size = 0
            async for size, chunk in self.manager.download(request.sandbox_id, request.path):
                pending += chunk
                while len(pending) >= DOWNLOAD_CHUNK:
                    yield pb.DownloadFileResponse(size_bytes=size, chunk=pending[:DOWNLOAD_CHUNK])
                    pending = pending[DOWNLOAD_CHUNK:]
                    sent_any = True
            if pending or not sent_any:
                yield pb.DownloadFileResponse(size_bytes=size, chunk=pending)
        except SandboxError as error:
            raise to_oma_error(error) from None


def sandbox_service(manager: SandboxManager) -> Service:
    return Service(
        SandboxServicer(manager),
        sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
        SERVICE_NAME,
    )
