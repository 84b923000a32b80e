"""`oma sandbox build-image`: build the sandbox image locally from Debian packages.

No registry is reachable where OMA runs its tests, so the image cannot be pulled: it is
bootstrapped with `debootstrap --variant=minbase` from a Debian mirror (reachable as a package
registry), given a non-root `sandbox` user and a `/workspace`, tarred, and `docker import`ed.
The tarball is cached, so a second build (or a `--force` rebuild) skips the bootstrap.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TAG = "oma-sandbox:latest"
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# python3 (the full one, with its standard library), the shell tools the built-in tools need,
# and git for repositories copied into the workspace.
PACKAGES = (
    "python3",
    "bash",
    "coreutils",
    "git",
    "grep",
    "findutils",
    "ca-certificates",
    "procps",
)
SANDBOX_UID = 1000
# Docker `import --change` directives: run as the unprivileged user in the workspace.
IMAGE_CHANGES = (
    f"USER {SANDBOX_UID}:{SANDBOX_UID}",
    "WORKDIR /workspace",
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV HOME=/workspace",
    "ENV LANG=C.UTF-8",
    'CMD ["/bin/bash"]',
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tag", default=DEFAULT_TAG, help=f"image name (default {DEFAULT_TAG})")
    parser.add_argument(
        "--force", action="store_true", help="rebuild even when the image already exists"
    )
    parser.add_argument(
        "--mirror", default=DEFAULT_MIRROR, help=f"Debian mirror (default {DEFAULT_MIRROR})"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where the root file system tarball is cached "
        "(default /var/cache/oma when writable, else $OMA_HOME/cache)",
    )


def default_cache_dir() -> Path:
    system = Path("/var/cache/oma")
    try:
        system.mkdir(parents=True, exist_ok=True)
        if os.access(system, os.W_OK):
            return system
    except OSError:
        pass
    home = Path(os.environ.get("OMA_HOME", Path.home() / ".oma"))
    return home / "cache"


def _progress(message: str) -> None:
    print(f"[build-image] {message}", flush=True)


def rootfs_tarball_name() -> str:
    key = hashlib.sha256(
        "\n".join([SUITE, *PACKAGES, str(SANDBOX_UID), "v1"]).encode()
    ).hexdigest()[:12]
    return f"oma-sandbox-rootfs-{SUITE}-{key}.tar"


def _add_sandbox_user(rootfs: Path) -> None:
    with (rootfs / "etc/passwd").open("a") as passwd:
        passwd.write(f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:OMA sandbox:/workspace:/bin/bash\n")
    with (rootfs / "etc/group").open("a") as group:
        group.write(f"sandbox:x:{SANDBOX_UID}:\n")
    workspace = rootfs / "workspace"
    workspace.mkdir(exist_ok=True)
    os.chown(workspace, SANDBOX_UID, SANDBOX_UID)


def _slim(rootfs: Path) -> None:
    """Drop what a sandbox never needs, to keep the image small and import fast."""
    for relative in (
        "var/cache/apt/archives",
        "var/lib/apt/lists",
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "usr/share/locale",
    ):
        target = rootfs / relative
        if target.is_dir():
            for child in target.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)


def build_rootfs_tarball(tarball: Path, mirror: str) -> None:
    if shutil.which("debootstrap") is None:
        raise SystemExit("debootstrap is not installed (apt-get install -y debootstrap)")
    if os.geteuid() != 0:
        raise SystemExit("debootstrap needs root: run `oma sandbox build-image` as root")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="oma-rootfs-", dir=tarball.parent) as tmp:
        rootfs = Path(tmp) / "rootfs"
        _progress(f"debootstrap --variant=minbase {SUITE} from {mirror} (a few minutes) ...")
        started = time.monotonic()
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(rootfs),
                mirror,
            ],
            check=True,
            stdout=subprocess.DEVNULL if not sys.stdout.isatty() else None,
        )
        _progress(f"bootstrapped in {time.monotonic() - started:.0f}s; adding the sandbox user")
        _add_sandbox_user(rootfs)
        _slim(rootfs)
        partial = tarball.with_suffix(".partial")
        _progress(f"writing {tarball}")
        subprocess.run(
            ["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."], check=True
        )
        partial.replace(tarball)


def image_exists(client: object, tag: str) -> bool:
    import docker.errors

    try:
        client.images.get(tag)  # type: ignore[attr-defined]
        return True
    except docker.errors.ImageNotFound:
        return False


def run(args: argparse.Namespace) -> int:
    import docker

    client = docker.from_env(timeout=600)
    if image_exists(client, args.tag) and not args.force:
        _progress(f"{args.tag} already exists; nothing to do (use --force to rebuild)")
        return 0
    cache_dir: Path = args.cache_dir or default_cache_dir()
    tarball = cache_dir / rootfs_tarball_name()
    if tarball.exists():
        _progress(f"using cached root file system {tarball}")
    else:
        build_rootfs_tarball(tarball, args.mirror)
    repository, _, tag = args.tag.rpartition(":")
    if not repository:
        repository, tag = args.tag, "latest"
    _progress(f"docker import as {args.tag} ...")
    client.api.import_image_from_file(
        str(tarball), repository=repository, tag=tag, changes=list(IMAGE_CHANGES)
    )
    image = client.images.get(args.tag)
    _progress(f"built {args.tag} ({image.short_id}, {image.attrs.get('Size', 0) / 1e6:.0f} MB)")
    return 0
