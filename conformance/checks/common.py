"""Checks every service must pass: authentication by role and health without a token."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from oma.conformance.checks._util import expect_error
from oma.conformance.registry import check
from oma.conformance.target import Target, _pb2_module

# One method per service that a client-role token may not call: proves roles are enforced.
ADMIN_OR_HARNESS_ONLY = {
    "session": ("AcquireLease", "AcquireLeaseRequest", {"session_id": "x", "holder_id": "h"}),
}


def _register(service: str) -> None:
    @check(service, "COMMON-AUTH-001")
    async def check_missing_and_unknown_tokens_are_unauthenticated(target: Target) -> None:
        request = _pb2_module(service).GetCapabilitiesRequest()
        await expect_error(target.stub(service, role="").GetCapabilities(request),
                           grpc.StatusCode.UNAUTHENTICATED, "TOKEN_MISSING")
        saved = target.tokens.get("bogus")
        target.tokens["bogus"] = "not-a-token-this-server-issued"
        try:
            await expect_error(target.stub(service, role="bogus").GetCapabilities(request),
                               grpc.StatusCode.UNAUTHENTICATED, "TOKEN_INVALID")
        finally:
            if saved is None:
                target.tokens.pop("bogus", None)

    @check(service, "COMMON-AUTH-002")
    async def check_health_needs_no_token(target: Target) -> None:
        health = health_pb2_grpc.HealthStub(target.channel(service, role=""))
        response = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert response.status == health_pb2.HealthCheckResponse.SERVING

    @check(service, "COMMON-CAP-001")
    async def check_capabilities_answer_a_client(target: Target) -> None:
        module = _pb2_module(service)
        response = await target.stub(service, role="client").GetCapabilities(
            module.GetCapabilitiesRequest())
        info = response.server_info
        assert info.implementation, "ServerInfo.implementation is empty"
        assert f"oma.{service}.v1" in info.api_versions, list(info.api_versions)

    if service in ADMIN_OR_HARNESS_ONLY:
        method, request_name, fields = ADMIN_OR_HARNESS_ONLY[service]

        @check(service, "COMMON-AUTH-001")
        async def check_a_client_token_cannot_call_a_harness_method(target: Target) -> None:
            request = getattr(_pb2_module(service), request_name)(**fields)
            call = getattr(target.stub(service, role="client"), method)(request)
            await expect_error(call, grpc.StatusCode.PERMISSION_DENIED, "ROLE_FORBIDDEN")


for _service in ("session", "sandbox", "vault", "harness"):
    _register(_service)
