"""Cloning a private repository outside any sandbox, leaving no trace of the token.

git gets the secret only as an `http.extraHeader` through `GIT_CONFIG_COUNT` environment
variables of its own process (never argv, never a file, never the remote URL); it runs with
an empty HOME, no system config, no credential helper, no redirects and only http(s)
transports. After the clone the checkout is searched for the secret in every encoding the
scrubber knows (plain, base64 as in the `Basic` header, ...), and the tar archive is built
from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tarfile
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from oma.servers.vault.errors import VaultError
from oma.servers.vault.models import Secret
from oma.servers.vault.scrub import Scrubber
from oma.servers.vault.upstream import auth_header

CHUNK_BYTES = 256 * 1024


@dataclass(frozen=True)
class ClonedRepository:
    commit: str
    ref: str
    archive: Path
    size: int


def git_environment(secret: Secret, home: Path) -> dict[str, str]:
    name, value = auth_header(secret)
    config = [
        ("http.extraHeader", f"{name}: {value}"),
        ("http.followRedirects", "false"),
        ("credential.helper", ""),
        ("core.askPass", ""),
        ("protocol.allow", "never"),
        ("protocol.http.allow", "always"),
        ("protocol.https.allow", "always"),
    ]
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ALLOW_PROTOCOL": "http:https",
        "LC_ALL": "C",
        "GIT_CONFIG_COUNT": str(len(config)),
    }
    for i, (key, val) in enumerate(config):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = val
    return env


async def _git(
    args: list[str], env: dict[str, str], cwd: Path, time_limit: float
) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        "git",
        *args,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        # Its own process group, so that git's helpers (git-remote-http holds the
        # connection and the output pipe) die with it.
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), time_limit)
    except BaseException as exc:
        # Timed out or cancelled (the caller went away): git must not live on with the
        # secret in its environment, writing into a directory about to be removed.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await asyncio.shield(process.wait())
        if isinstance(exc, TimeoutError):
            raise VaultError(
                "UPSTREAM_TIMEOUT", f"git {args[0]} took longer than {time_limit:.0f}s"
            ) from None
        raise
    return process.returncode or 0, out.decode("utf-8", errors="replace")


def find_secret(root: Path, scrubber: Scrubber) -> Path | None:
    """The first file under `root` holding the secret in any form the scrubber knows (the
    `Basic` header git sends carries the token base64-encoded, not plain)."""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and scrubber.finds(path.read_bytes()):
            return path
    return None


def _make_tar(source: Path, archive: Path) -> int:
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name)
    return archive.stat().st_size


async def clone(
    url: str,
    ref: str,
    depth: int,
    secret: Secret,
    scrubber: Scrubber,
    *,
    time_limit: float,
    max_bytes: int,
) -> tuple[ClonedRepository, Path]:
    """Clone into a private temporary directory; returns the result and the directory to
    remove when done (`remove_workdir`)."""
    workdir = Path(tempfile.mkdtemp(prefix="oma-vault-clone-"))
    try:
        home = workdir / "home"
        home.mkdir()
        checkout = workdir / "repo"
        env = git_environment(secret, home)
        args = ["clone", "--no-recurse-submodules", "--quiet"]
        if ref and depth > 0:
            args += ["--branch", ref]
        if depth > 0:
            args += ["--depth", str(depth)]
        code, output = await _git([*args, "--", url, str(checkout)], env, workdir, time_limit)
        if code != 0:
            message, _ = scrubber.scrub_text(output.strip()[-2000:])
            raise VaultError("CLONE_FAILED", f"git clone {url} failed: {message}", {"url": url})
        plain_env = {k: v for k, v in env.items() if not k.startswith("GIT_CONFIG_")}
        if ref and depth <= 0:
            # A full clone can check out any branch, tag or commit id, without the network.
            code, output = await _git(
                ["checkout", "--quiet", ref, "--"], plain_env, checkout, time_limit
            )
            if code != 0:
                message, _ = scrubber.scrub_text(output.strip()[-2000:])
                raise VaultError(
                    "CLONE_FAILED", f"git checkout {ref} in {url} failed: {message}", {"url": url}
                )
        # The checkout's remote must not carry credentials, whatever git wrote.
        await _git(["remote", "set-url", "origin", url], plain_env, checkout, time_limit)
        _, commit = await _git(["rev-parse", "HEAD"], plain_env, checkout, time_limit)
        _, branch = await _git(
            ["symbolic-ref", "--short", "-q", "HEAD"], plain_env, checkout, time_limit
        )
        leaked = await asyncio.to_thread(find_secret, checkout, scrubber)
        if leaked is not None:
            raise VaultError(
                "CLONE_FAILED",
                f"the checkout of {url} contains the credential's secret in "
                f"{leaked.relative_to(checkout)}; refusing to hand it to a sandbox",
                {"url": url},
            )
        archive = workdir / "repo.tar"
        size = await asyncio.to_thread(_make_tar, checkout, archive)
        if size > max_bytes:
            raise VaultError(
                "RESPONSE_TOO_LARGE",
                f"the checkout of {url} is {size} bytes as tar, above the limit of {max_bytes}",
                {"limit": str(max_bytes)},
            )
        return ClonedRepository(commit.strip(), branch.strip() or ref, archive, size), workdir
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise


async def archive_chunks(archive: Path) -> AsyncIterator[bytes]:
    with archive.open("rb") as source:
        while True:
            chunk = await asyncio.to_thread(source.read, CHUNK_BYTES)
            if not chunk:
                return
            yield chunk


def remove_workdir(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
