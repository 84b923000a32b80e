"""The contract as a product: it builds, lints, loads in another language, keeps its
requirement ids unique, and an incompatible change fails the breaking check."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "node_modules" / ".bin" / "buf"
DEPS = ROOT / "build" / "proto-deps"

# The RPCs issue 2 names; tools and the conformance suite call them by these exact names.
REQUIRED_RPCS = {
    "oma.session.v1.SessionService": {
        "GetCapabilities", "CreateSession", "GetSession", "ListSessions", "AppendEvents",
        "GetEvents", "StreamEvents", "AcquireLease", "RenewLease", "ReleaseLease",
    },
    "oma.sandbox.v1.SandboxService": {
        "GetCapabilities", "Provision", "Execute", "ExecuteStream", "GetSandbox",
        "ListSandboxes", "DestroySandbox", "UploadFile", "DownloadFile",
    },
    "oma.vault.v1.VaultService": {
        "GetCapabilities", "CreateCredential", "RotateCredential", "DeleteCredential",
        "ListCredentials", "IssueSessionToken", "RevokeSessionTokens", "Proxy", "ListAudit",
    },
    "oma.harness.v1.HarnessService": {"GetCapabilities", "Wake"},
}


@pytest.fixture(scope="module")
def buf() -> Path:
    if not BUF.exists():
        pytest.fail("buf is missing: run `npm ci` at the repository root", pytrace=False)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "proto_deps.py")], check=True)
    return BUF


def run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_buf_build_succeeds(buf: Path, tmp_path: Path) -> None:
    result = run([str(buf), "build", "proto", "-o", str(tmp_path / "image.binpb")], ROOT)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "image.binpb").stat().st_size > 0


def test_every_proto_loads_in_node_proto_loader(buf: Path) -> None:
    node = shutil.which("node")
    assert node, "node is required for the polyglot smoke test"
    result = subprocess.run(
        [node, str(Path(__file__).with_name("smoke_proto_loader.js")), str(ROOT / "proto"), str(DEPS)],
        capture_output=True, text=True, timeout=120,
        env={"NODE_PATH": str(ROOT / "node_modules"), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert loaded["files"] == len(list((ROOT / "proto" / "oma").rglob("*.proto")))
    for service, rpcs in REQUIRED_RPCS.items():
        assert service in loaded["services"], f"{service} did not load in Node"
        missing = rpcs - set(loaded["services"][service])
        assert not missing, f"{service} lacks {sorted(missing)}"


def _workspace_copy(tmp_path: Path) -> Path:
    work = tmp_path / "ws"
    shutil.copytree(ROOT / "proto", work / "proto", ignore=shutil.ignore_patterns("baseline"))
    shutil.copytree(DEPS, work / "build" / "proto-deps")
    shutil.copy(ROOT / "buf.yaml", work / "buf.yaml")
    return work


def test_renaming_a_v1_field_fails_the_breaking_check(buf: Path, tmp_path: Path) -> None:
    work = _workspace_copy(tmp_path)
    baseline = tmp_path / "baseline.binpb"
    assert run([str(buf), "build", "proto", "-o", str(baseline)], work).returncode == 0
    common = work / "proto" / "oma" / "common" / "v1" / "common.proto"
    text = common.read_text()
    assert "string implementation = 1;" in text
    common.write_text(text.replace("string implementation = 1;", "string implementation_name = 1;"))

    result = run([str(buf), "breaking", "proto", "--against", str(baseline)], work)
    assert result.returncode != 0, "renaming a field must be reported as breaking"
    assert re.search(r"implementation", result.stdout + result.stderr)

    # The unchanged contract passes against its own baseline: the check is not always red.
    common.write_text(text)
    assert run([str(buf), "breaking", "proto", "--against", str(baseline)], work).returncode == 0


def test_contract_passes_against_the_committed_baseline(buf: Path) -> None:
    result = run([str(buf), "breaking", "proto", "--against", "proto/baseline/oma.binpb"], ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def _check_ids(proto_root: Path) -> subprocess.CompletedProcess[str]:
    script = ROOT / "scripts" / "check_requirement_ids.py"
    return run([sys.executable, str(script), "--proto-root", str(proto_root)], ROOT)


def test_requirement_ids_are_unique_in_the_contract() -> None:
    result = _check_ids(ROOT / "proto")
    assert result.returncode == 0, result.stderr


def test_a_duplicated_requirement_id_fails_the_check(tmp_path: Path) -> None:
    proto = tmp_path / "oma" / "x" / "v1" / "x.proto"
    proto.parent.mkdir(parents=True)
    proto.write_text(
        "// [SESSION-DUP-001] The server MUST do one thing.\n"
        "message A {}\n"
        "// [SESSION-DUP-001] The server MUST do another thing.\n"
        "message B {}\n"
    )
    result = _check_ids(tmp_path)
    assert result.returncode == 1
    assert "duplicate requirement id SESSION-DUP-001" in result.stderr


def test_a_requirement_word_without_an_id_fails_the_check(tmp_path: Path) -> None:
    proto = tmp_path / "oma" / "x" / "v1" / "x.proto"
    proto.parent.mkdir(parents=True)
    proto.write_text("// The server MUST do a thing nobody can cite.\nmessage A {}\n")
    result = _check_ids(tmp_path)
    assert result.returncode == 1
    assert "'MUST' outside a requirement" in result.stderr


# Debian's protoc (package protobuf-compiler) carries the built-in generators of these
# languages; protoc-gen-go and protoc-gen-go-grpc come from Debian packages of the same names.
OTHER_LANGUAGES = ["java", "kotlin", "csharp", "cpp", "objc", "php", "ruby", "go", "go-grpc"]


@pytest.mark.parametrize("language", OTHER_LANGUAGES)
def test_the_contract_generates_cleanly_for_other_languages(
        buf: Path, language: str, tmp_path: Path) -> None:
    """Every file generates with the language options we set (go_package, java_package,
    csharp_namespace, php_namespace, ruby_package, objc_class_prefix), with no warning."""
    protoc = shutil.which("protoc")
    assert protoc, "protoc is required: apt-get install protobuf-compiler (scripts/setup.sh)"
    protos = sorted(p.relative_to(ROOT / "proto").as_posix()
                    for p in (ROOT / "proto").glob("oma/**/*.proto"))
    out = tmp_path / language
    out.mkdir()
    # go_package names the Go import path; `module=` strips its prefix so files land in `out`.
    options = "module=github.com/oma-dev/oma:" if language.startswith("go") else ""
    result = run([protoc, f"-I{ROOT / 'proto'}", f"-I{DEPS}", f"--{language}_out={options}{out}",
                  *protos], ROOT / "proto")
    assert result.returncode == 0, result.stderr
    assert any(p.is_file() for p in out.rglob("*")), f"protoc wrote no {language} output"
    assert "warning" not in result.stderr.lower(), result.stderr
