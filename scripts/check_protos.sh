#!/usr/bin/env bash
# Every check on the contract, in the order a proto author wants to hear about problems:
# buf lint (STANDARD + COMMENTS), buf format, requirement ids, breaking changes against the
# released baseline, then freshness of the generated stubs in gen/.
set -euo pipefail
cd "$(dirname "$0")/.."
BUF=node_modules/.bin/buf
[ -x "$BUF" ] || { echo "buf missing: run 'npm ci' (or 'npm install') in $(pwd)" >&2; exit 2; }

python scripts/proto_deps.py
echo "== buf lint";             "$BUF" lint
echo "== buf format";           "$BUF" format -d --exit-code
echo "== requirement ids";      python scripts/check_requirement_ids.py
if [ -f proto/baseline/oma.binpb ]; then
  echo "== buf breaking (against proto/baseline/oma.binpb)"
  "$BUF" breaking proto --against proto/baseline/oma.binpb
else
  echo "== buf breaking: no baseline yet (run scripts/release_contract.sh)" >&2
  exit 1
fi
echo "== gen/ freshness";       python scripts/gen_protos.py --check
echo "contract checks passed"
