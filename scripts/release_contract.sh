#!/usr/bin/env bash
# The release step of the contract: records the current proto/ as the baseline that
# `buf breaking` (in scripts/check_protos.sh and CI) compares every later change against.
#
# Run it only on purpose: when a refinement of v1 that breaks wire or source compatibility
# has been agreed, or when a new contract version is released. Say why in the commit that
# changes proto/baseline/oma.binpb. An accidental incompatible change then fails CI instead
# of reaching users.
set -euo pipefail
cd "$(dirname "$0")/.."
python scripts/proto_deps.py
mkdir -p proto/baseline
node_modules/.bin/buf build proto -o proto/baseline/oma.binpb
echo "baseline written: proto/baseline/oma.binpb ($(wc -c < proto/baseline/oma.binpb) bytes)"
echo "commit it with a message that says why the contract's baseline moves."
