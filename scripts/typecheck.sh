#!/usr/bin/env bash
# mypy --strict on the installed package layout: kvpush.services (services/), kvpush.connector
# (connector/) and kvpush.v1 (proto/kvpush/v1). mypy does not run the editable install's import
# hook, so the same layout is linked into a scratch directory and checked there.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/kvpush"
cp proto/kvpush/__init__.py "$tree/kvpush/"
ln -s "$root/proto/kvpush/v1" "$tree/kvpush/v1"
ln -s "$root/services" "$tree/kvpush/services"
ln -s "$root/connector" "$tree/kvpush/connector"
cd "$tree"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  -p kvpush.services -p kvpush.connector
