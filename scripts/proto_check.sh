#!/usr/bin/env bash
# Regenerates the protobuf code into a scratch directory and compares it with the committed files.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/out"
.venv/bin/python -m grpc_tools.protoc -Iproto \
  --python_out="$tmp/out" --grpc_python_out="$tmp/out" \
  --mypy_out="$tmp/out" --mypy_grpc_out="$tmp/out" \
  --plugin=protoc-gen-mypy=.venv/bin/protoc-gen-mypy \
  --plugin=protoc-gen-mypy_grpc=.venv/bin/protoc-gen-mypy_grpc \
  proto/kvpush/v1/kvpush.proto
for f in "$tmp"/out/kvpush/v1/*; do
  name=$(basename "$f")
  if ! cmp -s "$f" "proto/kvpush/v1/$name"; then
    echo "proto-check: proto/kvpush/v1/$name is stale; run 'make proto' and commit" >&2
    exit 1
  fi
done
echo "proto-check: generated code is up to date"
