"""`oma demo` as a newcomer runs it: a fresh virtual environment, an empty HOME and data
directory, no API key, no network beyond 127.0.0.1."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_a_sandbox_backend() -> None:
    """`oma demo` needs Docker with the sandbox image, or bubblewrap (as tests/conftest.py's
    `require`: skipped on a machine without either, a failure under CI)."""
    from oma.cli._stack import docker_usable

    image = os.environ.get("OMA_SANDBOX_IMAGE", "oma-sandbox:latest")
    if docker_usable(image) or shutil.which("bwrap") is not None:
        return
    what = "a sandbox backend (Docker with the sandbox image, or bubblewrap)"
    if IN_CI:
        pytest.fail(f"{what} is required in CI", pytrace=False)
    pytest.skip(f"{what} is not available")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_oma_demo_in_a_fresh_venv(tmp_path: Path) -> None:
    require_a_sandbox_backend()
    venv = tmp_path / "venv"
    # --system-site-packages keeps it fast and offline: the dependencies come from the
    # machine's environment, while `oma` itself is installed into the new venv.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    # A real (non-editable) install of the wheel, built offline with this machine's setuptools.
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(ROOT),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("oma-*.whl")
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
        check=True,
        timeout=300,
    )
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "OMA_")) and k not in ("HOME", "VIRTUAL_ENV")
    }
    env.update(
        HOME=str(home),
        OMA_HOME=str(home / ".oma"),
        NO_COLOR="1",
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    )
    oma = venv / "bin" / "oma"
    assert shutil.which("oma", path=env["PATH"]) == str(oma)
    result = subprocess.run(
        [str(oma), "demo"], env=env, cwd=home, capture_output=True, text=True, timeout=600
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"tool use\s+write primes\.py", output), output
    assert re.search(r"tool use\s+bash \$ python3 primes\.py", output), output
    assert "tool result" in output and "primes below 50: [2, 3, 5, 7" in output, output
    assert "count: 15" in output, output
    assert "There are 15 primes below 50" in output, output
    assert "idle (end_turn)" in output, output
    # Everything it kept is under the temporary data directory.
    assert (home / ".oma" / "tokens.json").is_file()
