"""`oma.harness.v1.HarnessService` over the `Driver` core."""

from __future__ import annotations

import re

import grpc

from oma import __version__
from oma.common.v1 import common_pb2
from oma.harness.v1 import harness_pb2, harness_pb2_grpc
from oma.runtime.errors import OmaError, invalid_field
from oma.servers.harness.driver import Driver, Outcome
from oma.servers.harness.ports import SessionGone, Unreachable

SERVICE_NAME = "oma.harness.v1.HarnessService"
_SESSION_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")

_OUTCOMES = {
    Outcome.STARTED: harness_pb2.WAKE_OUTCOME_STARTED,
    Outcome.ALREADY_DRIVEN: harness_pb2.WAKE_OUTCOME_ALREADY_DRIVEN,
    Outcome.NOTHING_TO_DO: harness_pb2.WAKE_OUTCOME_NOTHING_TO_DO,
}


class HarnessServicer(harness_pb2_grpc.HarnessServiceServicer):
    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    async def GetCapabilities(
        self, request: harness_pb2.GetCapabilitiesRequest, context: grpc.aio.ServicerContext
    ) -> harness_pb2.GetCapabilitiesResponse:
        config = self._driver.config
        limits = {
            "harness.max_model_retries": config.loop.max_model_retries,
            "harness.lease_ttl_ms": int(config.lease_ttl_seconds * 1000),
        }
        budget = getattr(config.loop.context, "budget_tokens", None)
        if isinstance(budget, int):  # only a policy with a token budget has one to declare
            limits["harness.context_budget_tokens"] = budget
        info = common_pb2.ServerInfo(
            implementation="oma-reference",
            version=__version__,
            api_versions=["oma.harness.v1"],
            features=["harness.previews", "harness.sandbox_tools", "harness.mcp_tools"],
            limits=limits,
        )
        return harness_pb2.GetCapabilitiesResponse(server_info=info)

    async def Wake(
        self, request: harness_pb2.WakeRequest, context: grpc.aio.ServicerContext
    ) -> harness_pb2.WakeResponse:
        if not _SESSION_ID.match(request.session_id):
            raise invalid_field(
                "session_id",
                "must be 1-128 characters of [A-Za-z0-9._-], as returned by CreateSession",
            )
        try:
            result = await self._driver.wake(request.session_id)
        except SessionGone as gone:
            if gone.terminated:
                raise OmaError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "SESSION_TERMINATED",
                    str(gone),
                    {"session_id": request.session_id},
                ) from gone
            raise OmaError(
                grpc.StatusCode.NOT_FOUND,
                "SESSION_NOT_FOUND",
                str(gone),
                {"session_id": request.session_id},
            ) from gone
        except Unreachable as error:
            raise OmaError(
                grpc.StatusCode.UNAVAILABLE,
                "HARNESS_UNAVAILABLE",
                f"this harness cannot drive the session now ({error}); retry later or wake "
                "another harness",
            ) from error
        return harness_pb2.WakeResponse(
            outcome=_OUTCOMES[result.outcome], holder_id=result.holder_id, last_seq=result.last_seq
        )
