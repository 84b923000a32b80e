#!/usr/bin/env python3
"""Regenerate the committed Python stubs in gen/ from proto/.

    python scripts/gen_protos.py          # rewrite gen/
    python scripts/gen_protos.py --check  # exit 1 if gen/ is stale (CI)

Uses grpcio-tools' bundled protoc (no network) with mypy-protobuf for typed `.pyi` stubs.
The generated code imports absolutely from the proto path (`from oma.common.v1 import ...`),
so gen/ is a source root; src/oma/<service> are symlinks into it.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
GEN_DIR = ROOT / "gen"
# The requirement table the conformance suite cites, derived from the contract's comments.
REQUIREMENTS_TABLE = ROOT / "conformance" / "requirements.json"


def dependency_include_dirs() -> list[Path]:
    """Directories holding google/protobuf, google/rpc and google/api .proto files."""
    import google.api.field_behavior_pb2 as field_behavior
    import grpc_tools

    googleapis_root = Path(field_behavior.__file__).resolve().parent.parent.parent
    return [Path(grpc_tools.__file__).resolve().parent / "_proto", googleapis_root]


def generate(out_dir: Path) -> None:
    protos = sorted(p.relative_to(PROTO_DIR).as_posix() for p in PROTO_DIR.glob("oma/**/*.proto"))
    if not protos:
        sys.exit("no .proto files under proto/oma")
    includes = [f"-I{PROTO_DIR}"] + [f"-I{d}" for d in dependency_include_dirs()]
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", *includes,
        f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}", f"--mypy_grpc_out={out_dir}", *protos,
    ]
    # protoc-gen-mypy chatters "Writing mypy to ..." on stderr; show it only on failure.
    result = subprocess.run(cmd, cwd=PROTO_DIR, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"protoc failed:\n{result.stderr}")
    # Make every generated directory a regular package so it installs and type-checks.
    for directory in [out_dir / "oma", *(p for p in (out_dir / "oma").rglob("*") if p.is_dir())]:
        if directory == out_dir / "oma":
            continue  # `oma` itself is the hand-written package in src/oma
        (directory / "__init__.py").touch()
        (directory / "py.typed").touch()


def trees_equal(a: Path, b: Path) -> list[str]:
    """Relative paths that differ between two trees (ignoring __pycache__)."""
    def files(root: Path) -> set[str]:
        return {p.relative_to(root).as_posix() for p in root.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    fa, fb = files(a), files(b)
    diff = sorted(fa ^ fb)
    diff += sorted(f for f in fa & fb if not filecmp.cmp(a / f, b / f, shallow=False))
    return diff


def sync_tree(source: Path, dest: Path) -> None:
    """Make dest equal to source, touching only files that changed, so that code importing
    gen/ while it is being regenerated never sees it missing."""
    for rel in trees_equal(source, dest) if dest.exists() else ["."]:
        src, dst = source / rel, dest / rel
        if rel == "." or src.is_dir():
            shutil.copytree(source, dest, dirs_exist_ok=True)
            return
        if src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        else:
            dst.unlink()


def requirements_table() -> str:
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_requirement_ids import scan

    requirements, errors = scan(PROTO_DIR)
    if errors:
        sys.exit("requirement ids are broken; run scripts/check_requirement_ids.py")
    rows = [{"id": r.id, "level": r.level, "file": r.file, "line": r.line, "text": r.text}
            for r in requirements]
    return json.dumps(rows, indent=1) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if gen/ is not up to date")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "gen"
        fresh.mkdir()
        generate(fresh)
        if args.check:
            stale = trees_equal(fresh, GEN_DIR) if GEN_DIR.exists() else ["gen/ missing"]
            table = REQUIREMENTS_TABLE.read_text() if REQUIREMENTS_TABLE.exists() else ""
            if table != requirements_table():
                stale.append(REQUIREMENTS_TABLE.relative_to(ROOT).as_posix())
            if stale:
                print("gen/ is stale; run `python scripts/gen_protos.py`. Differs:", *stale[:20],
                      sep="\n  ", file=sys.stderr)
                return 1
            print("gen/ is up to date")
            return 0
        sync_tree(fresh, GEN_DIR)
    REQUIREMENTS_TABLE.write_text(requirements_table())
    print(f"generated stubs for {len(list(GEN_DIR.rglob('*_pb2.py')))} proto files in gen/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
