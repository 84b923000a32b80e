"""A scripted model server and an `anthropic` SDK client pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import pytest
from model_server_scripts import SCRIPTS

from oma.servers.harness.model_server import AsyncModelServer, start_model_server


@pytest.fixture
async def model_server() -> AsyncIterator[AsyncModelServer]:
    server = await start_model_server(SCRIPTS)
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def client(model_server: AsyncModelServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=model_server.base_url, api_key="test", max_retries=0
    ) as c:
        yield c
