#!/usr/bin/env bash
# The test command: prepares the machine (scripts/setup.sh), then runs every check CI runs —
# ruff, mypy (outside gen/), the contract checks (buf lint/format/breaking, requirement ids,
# gen/ freshness) and the whole pytest suite against real engines. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMA_TEST_PG_DSN="${OMA_TEST_PG_DSN:-postgresql://oma:oma@127.0.0.1:5432/postgres}"
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }
step "ruff";      ruff check .
step "mypy";      mypy
step "contract";  bash scripts/check_protos.sh
step "pytest";    python3 -m pytest -q -p no:cacheprovider --junitxml=build/junit.xml "$@"
