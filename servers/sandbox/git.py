"""Cloning repositories for init steps, outside the sandbox.

Sandboxes have no network, and credentials must never enter them, so the server clones on the
host into a private temporary directory and copies the checked-out tree into the workspace.
`RepositoryFetcher` is the seam: the reference `PublicRepositoryFetcher` clones repositories
that need no credential; a vault-backed fetcher (`oma serve sandbox --vault ADDR`) resolves a
repository's `credential_id` through the vault with the session token.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Protocol

from oma.servers.sandbox.model import GitRepository, SandboxError

CLONE_TIMEOUT_SECONDS = 300.0
ALLOWED_SCHEMES = ("https://", "http://", "git://", "ssh://")


class RepositoryFetcher(Protocol):
    """Puts a checkout of `repo` at `dest` (which does not exist yet) on the server's host."""

    async def fetch(self, repo: GitRepository, dest: Path, vault_session_token: str) -> None:
        """Raises `SandboxError` (reason `INIT_FAILED`) with a message a person can act on."""
        ...


class PublicRepositoryFetcher:
    """Anonymous clones; a repository with a credential needs a vault-backed fetcher."""

    def __init__(self, *, allow_file_urls: bool = False) -> None:
        self.allow_file_urls = allow_file_urls

    async def fetch(self, repo: GitRepository, dest: Path, vault_session_token: str) -> None:
        if repo.credential_id:
            raise SandboxError(
                "INIT_FAILED",
                f"repository {repo.url} needs credential {repo.credential_id!r}, but this "
                "sandbox server has no vault configured (start it with `--vault ADDR`)",
            )
        await clone(repo.url, repo.ref, dest, allow_file_urls=self.allow_file_urls)


async def clone(
    url: str,
    ref: str,
    dest: Path,
    *,
    extra_config: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    allow_file_urls: bool = False,
) -> None:
    """`git clone` then, when `ref` is set, check it out (a branch, tag or commit)."""
    schemes = ALLOWED_SCHEMES + (("file://",) if allow_file_urls else ())
    if not url.startswith(schemes):
        raise SandboxError(
            "INIT_FAILED", f"cannot clone {url!r}: the URL must start with one of {schemes}"
        )
    base_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(dest.parent),
        "LANG": "C.UTF-8",
    }
    base_env.update(env or {})
    config: list[str] = []
    for item in ("protocol.allow=never", "protocol.https.allow=always",
                 "protocol.http.allow=always", "protocol.git.allow=always",
                 "protocol.ssh.allow=always", *extra_config):  # fmt: skip
        config += ["-c", item]
    if allow_file_urls:
        config += ["-c", "protocol.file.allow=always"]
    await _git([*config, "clone", "--quiet", "--no-checkout", "--", url, str(dest)], base_env, url)
    await _git(
        [*config, "-C", str(dest), "checkout", "--quiet", ref or "HEAD", "--"], base_env, url
    )


async def _git(args: list[str], env: dict[str, str], url: str) -> None:
    process = await asyncio.create_subprocess_exec(
        "git",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        # Its own process group, so that git's helpers (git-remote-http holds the
        # connection and the output pipe) die with it.
        start_new_session=True,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), CLONE_TIMEOUT_SECONDS)
    except BaseException as error:
        # Timed out or cancelled (the provision was abandoned): nothing may go on cloning.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.shield(process.wait())
        if isinstance(error, TimeoutError):
            raise SandboxError(
                "INIT_FAILED", f"cloning {url} took longer than {CLONE_TIMEOUT_SECONDS:.0f} s"
            ) from error
        raise
    if process.returncode != 0:
        detail = output.decode(errors="replace").strip()[-1000:]
        step = "clone" if "clone" in args else "checkout"
        raise SandboxError("INIT_FAILED", f"git {step} of {url} failed: {detail}")
