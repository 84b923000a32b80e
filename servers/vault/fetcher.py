"""A sandbox server's `RepositoryFetcher` that clones private repositories through the vault.

The sandbox server holds no git token: it calls `VaultService.CloneRepository` with its
`sandbox_server` role token and the session token the provision request carried, and
unpacks the token-free archive the vault streams back. Repositories without a credential
are cloned anonymously, as before.
"""

from __future__ import annotations

import asyncio
import tarfile
import tempfile
from pathlib import Path

import grpc

from oma.runtime.client import ClientTls, connect
from oma.runtime.errors import reason_of
from oma.servers.sandbox.git import PublicRepositoryFetcher, RepositoryFetcher
from oma.servers.sandbox.model import GitRepository, SandboxError
from oma.vault.v1 import vault_pb2, vault_pb2_grpc


def _unpack(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        # The "data" filter refuses absolute paths, links leaving dest and device files.
        tar.extractall(dest, filter="data")


class VaultRepositoryFetcher:
    """Clones repositories that name a credential through the vault at `address`."""

    def __init__(
        self,
        address: str,
        token: str,
        *,
        tls: ClientTls | None = None,
        public: RepositoryFetcher | None = None,
    ) -> None:
        self.address = address
        self.token = token
        self.tls = tls
        self.public: RepositoryFetcher = public or PublicRepositoryFetcher()

    async def fetch(self, repo: GitRepository, dest: Path, vault_session_token: str) -> None:
        if not repo.credential_id:
            await self.public.fetch(repo, dest, vault_session_token)
            return
        if not vault_session_token:
            raise SandboxError(
                "INIT_FAILED",
                f"repository {repo.url} needs credential {repo.credential_id!r}, but the "
                "provision request carried no vault_session_token",
            )
        request = vault_pb2.CloneRepositoryRequest(
            session_token=vault_session_token,
            credential_id=repo.credential_id,
            url=repo.url,
            ref=repo.ref,
        )
        with tempfile.TemporaryDirectory(prefix="oma-vault-fetch-", dir=dest.parent) as tmp:
            archive = Path(tmp) / "checkout.tar"
            try:
                async with connect(self.address, token=self.token, tls=self.tls) as channel:
                    stub = vault_pb2_grpc.VaultServiceStub(channel)
                    with archive.open("wb") as out:
                        async for message in stub.CloneRepository(request):
                            if message.HasField("tar_chunk"):
                                await asyncio.to_thread(out.write, message.tar_chunk)
            except grpc.aio.AioRpcError as exc:
                reason = reason_of(exc) or exc.code().name
                raise SandboxError(
                    "INIT_FAILED",
                    f"cloning {repo.url} through the vault failed ({reason}): {exc.details()}",
                ) from None
            await asyncio.to_thread(_unpack, archive, dest)
