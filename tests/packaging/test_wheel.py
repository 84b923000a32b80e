"""The package installs as one `oma` namespace: generated stubs, servers, conformance and
bench all under `oma.*`, nothing at the top level but `oma` itself."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = out.glob("oma-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        ENTRY_POINTS.append(archive.read(entry_points).decode())
        return names


ENTRY_POINTS: list[str] = []


def test_everything_installs_under_the_oma_namespace(wheel_names: set[str]) -> None:
    top_levels = {name.split("/", 1)[0] for name in wheel_names}
    assert {t for t in top_levels if not t.endswith(".dist-info")} == {"oma"}


def test_wheel_carries_stubs_servers_and_typed_markers(wheel_names: set[str]) -> None:
    assert "oma/common/v1/common_pb2.py" in wheel_names
    assert "oma/common/v1/common_pb2.pyi" in wheel_names
    assert "oma/py.typed" in wheel_names
    assert "oma/cli/main.py" in wheel_names
    assert any(name.startswith("oma/servers/") for name in wheel_names)


def test_console_script_is_oma(wheel_names: set[str]) -> None:
    assert wheel_names
    assert "oma = oma.cli.main:main" in ENTRY_POINTS[0]
