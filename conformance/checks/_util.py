"""Helpers the checks share: expecting a status with its ErrorInfo reason."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any

import grpc

from oma.runtime.errors import reason_of


async def expect_error(call: Awaitable[Any], code: grpc.StatusCode, reason: str) -> None:
    """Await `call` and assert it fails with `code` and ErrorInfo `reason` (domain oma.dev)."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        got = (error.code(), reason_of(error))
        assert got == (code, reason), (
            f"expected {code.name}/{reason}, got {error.code().name}/{got[1]}: {error.details()}")
        return
    raise AssertionError(f"expected {code.name}/{reason}, but the call succeeded")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
