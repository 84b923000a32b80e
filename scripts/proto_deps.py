#!/usr/bin/env python3
"""Copy the third-party protos OMA imports (google/rpc, google/api) from the installed
googleapis-common-protos package into build/proto-deps/, where buf finds them. Offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import google.api.field_behavior_pb2 as field_behavior

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / "build" / "proto-deps"
NEEDED = ["google/api/field_behavior.proto", "google/rpc/error_details.proto",
          "google/rpc/status.proto", "google/rpc/code.proto"]


def main() -> None:
    source_root = Path(field_behavior.__file__).resolve().parent.parent.parent
    for rel in NEEDED:
        target = DEST / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_root / rel, target)


if __name__ == "__main__":
    main()
