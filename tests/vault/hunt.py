"""Runs INSIDE a sandbox, as a hostile tool would: looks for the secrets everywhere it can.

The needles arrive hex-encoded and reversed, so neither this file, nor the command line, nor
the environment contains them; they exist only in this process's memory. Prints one line per
finding (`FOUND`, `READABLE`, `REACHABLE`) and a `SCANNED` summary.

    python3 hunt.py NEEDLES_HEX_REVERSED,... NOT_BEFORE_EPOCH PATHS,... HOST:PORT,... REPO_DIR
"""

import base64
import os
import socket
import subprocess
import sys


def forms(secret):
    found = {secret}
    for prefix in (b"", b"a", b"ab", b"x-access-token:"):
        encoded = base64.b64encode(prefix + secret)
        skip = -(-8 * len(prefix) // 6)
        found.add(encoded[skip : (8 * (len(prefix) + len(secret))) // 6])
    return {f for f in found if len(f) >= 8}


def main():
    needles = set()
    for item in sys.argv[1].split(","):
        needles |= forms(bytes.fromhex(item[::-1]))
    not_before = float(sys.argv[2])
    private_paths = [p for p in sys.argv[3].split(",") if p]
    targets = [t for t in sys.argv[4].split(",") if t]
    repo = sys.argv[5]

    def hit(data):
        return any(n in data for n in needles)

    # 1. Our own environment, and every process's environment and command line.
    if hit("\0".join(f"{k}={v}" for k, v in os.environ.items()).encode()):
        print("FOUND own environment")
    me = str(os.getpid())
    procs = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            procs += 1
            if hit(data):
                print(f"FOUND /proc/{pid}/{name}")

    # 2. Every readable file. A file whose inode changed before the secrets existed cannot
    # hold them, so only newer files are read (the walk still visits every file).
    visited = read = 0
    for top, dirs, files in os.walk("/", onerror=lambda e: None):
        if top == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys", "dev")]
        for name in files:
            path = os.path.join(top, name)
            visited += 1
            try:
                st = os.lstat(path)
                if not os.path.isfile(path) or os.path.islink(path):
                    continue
                if max(st.st_ctime, st.st_mtime) < not_before or st.st_size > 256 * 1024 * 1024:
                    continue
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            read += 1
            if hit(data):
                print(f"FOUND {path}")

    # 3. The cloned repository's git configuration as git itself reports it.
    try:
        config = subprocess.run(
            ["git", "-C", repo, "config", "--list", "--show-origin"],
            capture_output=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
        )
        if hit(config.stdout) or hit(config.stderr):
            print("FOUND git config")
        remote = subprocess.run(
            ["git", "-C", repo, "remote", "-v"],
            capture_output=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
        )
        print("REMOTE", remote.stdout.decode().split("\n")[0])
    except Exception as exc:
        print(f"GITERROR {exc!r}")
    if os.path.isfile(os.path.join(repo, "README.md")) and os.path.isdir(
        os.path.join(repo, ".git")
    ):
        print("REPO_OK")

    # 4. The vault's key and database files by their paths on the host.
    for path in private_paths:
        try:
            with open(path, "rb") as f:
                f.read(1)
            print(f"READABLE {path}")
        except OSError:
            pass

    # 5. The network: the vault, the upstreams, the database.
    for target in targets:
        host, _, port = target.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                print(f"REACHABLE {target}")
        except OSError:
            pass

    print(f"SCANNED files={visited} read={read} procs={procs}")


main()
