"""The conformance suite against the reference servers: every check passes, the reports say
so, and the suite catches a server that breaks the contract."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from oma.conformance.report import by_requirement, write_junit
from oma.conformance.runner import Outcome, run_suite
from oma.conformance.target import Target
from oma.runtime.auth import TokenTable
from oma.runtime.server import ServerOptions
from oma.servers.session.server import SessionServer
from oma.servers.session.servicer import SessionServicer
from oma.session.v1 import session_service_pb2 as pb


@pytest.fixture
def tokens() -> TokenTable:
    return TokenTable.generate()


@pytest.fixture
async def session_server(tmp_path: Path, tokens: TokenTable) -> AsyncIterator[SessionServer]:
    server = await SessionServer.start(f"sqlite:///{tmp_path / 's.db'}",
                                       ServerOptions(tokens=tokens, grace_seconds=0.2))
    yield server
    await server.stop(0.2)


def _target(address: str, tokens: TokenTable) -> Target:
    roles = ("client", "harness", "sandbox_server", "admin")
    return Target({"session": address}, {r: tokens.token_for(r) for r in roles})


async def test_reference_session_server_passes_every_check(
        session_server: SessionServer, tokens: TokenTable, tmp_path: Path) -> None:
    target = _target(session_server.address, tokens)
    try:
        results = await run_suite(target, ["session"])
    finally:
        await target.close()
    assert len(results) >= 10
    failures = [f"{r.check.name}: {r.detail}" for r in results if r.outcome != Outcome.PASS]
    assert not failures, failures

    junit = tmp_path / "junit.xml"
    write_junit(results, junit)
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0" and suite.get("tests") == str(len(results))
    rollup = by_requirement(results)
    assert rollup["SESSION-APPEND-003"]["outcome"] == "pass"


class _LenientGetSession(SessionServicer):
    """Breaks SESSION-GET-001: answers an unknown id with an empty session."""

    async def GetSession(self, request: pb.GetSessionRequest, context: Any) -> pb.GetSessionResponse:
        try:
            return await super().GetSession(request, context)
        except Exception:
            return pb.GetSessionResponse()


async def test_the_suite_fails_a_server_that_breaks_a_must(
        tmp_path: Path, tokens: TokenTable, monkeypatch: pytest.MonkeyPatch) -> None:
    import oma.servers.session.server as server_module

    monkeypatch.setattr(server_module, "SessionServicer", _LenientGetSession)
    server = await SessionServer.start(f"sqlite:///{tmp_path / 'b.db'}",
                                       ServerOptions(tokens=tokens, grace_seconds=0.2))
    target = _target(server.address, tokens)
    try:
        results = await run_suite(target, ["session"], name_filter="unknown_session")
    finally:
        await target.close()
        await server.stop(0.2)
    (result,) = results
    assert result.outcome == Outcome.FAIL and result.blocks_run
    assert grpc.StatusCode.NOT_FOUND.name in result.detail


async def test_oma_conformance_command_against_an_address(
        session_server: SessionServer, tokens: TokenTable, tmp_path: Path) -> None:
    import asyncio
    import json
    import sys

    tokens_file = tmp_path / "tokens.json"
    tokens.save(tokens_file)
    junit, report = tmp_path / "junit.xml", tmp_path / "report.json"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "oma.cli.main", "conformance", "--session", session_server.address,
        "--tokens", str(tokens_file), "--junit", str(junit), "--json", str(report),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await process.communicate()
    text = output.decode()
    assert process.returncode == 0, text
    assert "0 failed" in text and "PASS MUST   session.a_mixed_batch_is_refused_whole" in text
    assert json.loads(report.read_text())["requirements"]["SESSION-GET-001"]["outcome"] == "pass"
    assert ET.parse(junit).getroot().tag == "testsuites"
