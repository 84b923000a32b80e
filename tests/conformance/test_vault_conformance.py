"""The conformance suite's vault checks pass against the reference vault server."""

from __future__ import annotations

from pathlib import Path

from oma.conformance.runner import Outcome, run_suite
from oma.conformance.target import Target
from oma.runtime.auth import TokenTable
from oma.runtime.server import ServerOptions, Service, start_server
from oma.servers.vault.cli import build_vault
from oma.servers.vault.core import Vault
from oma.servers.vault.service import SERVICE_NAME, VaultServicer
from oma.vault.v1 import vault_pb2_grpc


async def test_reference_vault_server_passes_every_check(tmp_path: Path) -> None:
    vault = await build_vault(f"sqlite+aiosqlite:///{tmp_path / 'vault.db'}", tmp_path / "key")
    assert isinstance(vault, Vault)
    tokens = TokenTable.generate()
    running = await start_server(
        [Service(VaultServicer(vault, None), vault_pb2_grpc.add_VaultServiceServicer_to_server,
                 SERVICE_NAME)],
        ServerOptions(tokens=tokens, grace_seconds=0.2))
    roles = ("client", "harness", "sandbox_server", "admin")
    target = Target({"vault": running.address}, {r: tokens.token_for(r) for r in roles})
    try:
        results = await run_suite(target, ["vault"])
    finally:
        await target.close()
        await running.stop(0.2)
        await vault.close()
    assert len(results) >= 8
    failures = [f"{r.check.name}: {r.detail}" for r in results if r.outcome != Outcome.PASS]
    assert not failures, failures
