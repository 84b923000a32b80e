#!/usr/bin/env bash
# Prepare this machine for OMA: the Debian packages and engines it uses (Docker engine,
# PostgreSQL, bubblewrap, debootstrap, git, Node.js for buf, protoc with the Go plugins for
# the polyglot generation test), the Python package with its
# dev tools, the Node tools, and the locally built sandbox image. Idempotent: a second run
# only checks. Needs root (or sudo) for the system parts.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
as_postgres() { if [ "$(id -u)" = 0 ]; then su postgres -c "$*"; else sudo -u postgres bash -c "$*"; fi; }

step "system packages"
missing=()
for p in docker.io postgresql bubblewrap debootstrap git ca-certificates \
         protobuf-compiler protoc-gen-go protoc-gen-go-grpc; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "all present"
fi

step "Docker engine"
if ! docker info >/dev/null 2>&1; then
  # A session's processes are ended before CI runs; clear what a killed daemon leaves behind.
  pgrep -x dockerd >/dev/null || $SUDO rm -f /var/run/docker.pid /var/run/docker.sock
  $SUDO bash -c 'nohup dockerd >/var/log/oma-dockerd.log 2>&1 &'
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
docker info --format 'docker {{.ServerVersion}}, cgroup v{{.CgroupVersion}}' || { tail -20 /var/log/oma-dockerd.log; exit 1; }

step "PostgreSQL"
PG_VERSION=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! pg_lsclusters -h | awk '{print $4}' | grep -q online; then
  $SUDO pg_ctlcluster "$PG_VERSION" main start
fi
for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 && break; sleep 1; done
as_postgres "psql -qtc \"SELECT 1 FROM pg_roles WHERE rolname='oma'\"" | grep -q 1 \
  || as_postgres "psql -qc \"CREATE ROLE oma LOGIN SUPERUSER PASSWORD 'oma'\""
pg_isready -h 127.0.0.1

step "Python package (editable, with dev tools)"
python3 -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v -e 'Running pip as the' -e 'is ignored: it is neither' || true
oma --version

step "Node tools (buf, proto-loader)"
if [ ! -x node_modules/.bin/buf ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund --loglevel=error
fi
node_modules/.bin/buf --version

step "sandbox image"
if oma sandbox build-image --help >/dev/null 2>&1; then
  oma sandbox build-image
else
  echo "oma sandbox build-image is not available in this checkout; skipped"
fi
step "setup done"
