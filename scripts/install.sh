#!/usr/bin/env bash
# Idempotent environment set-up: creates .venv from scratch, or brings a stale one up to date.
# A stamp holds the hash of the inputs; when they have not changed this exits at once.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${VENV:-.venv}
FIND_LINKS=${PIP_FIND_LINKS:-/opt/wheels}
want=$(cat requirements.lock pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
stamp="$V/.kvpush-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$V/bin/python" ]; then
  exit 0
fi
echo "install: setting up $V" >&2
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/python" -m pip install -q "uv==0.13.8"
UV="$V/bin/uv"
# torch==2.13.0+cpu comes from the local wheel directory; everything else from the package index.
"$UV" pip sync --python "$V/bin/python" --find-links "$FIND_LINKS" --compile-bytecode -q requirements.lock
"$UV" pip install --python "$V/bin/python" --no-deps --no-build-isolation -q -e .
"$V/bin/python" -c "import grpc, nixl_cu12._api, structlog, vllm" >/dev/null
echo "$want" > "$stamp"
echo "install: done" >&2
