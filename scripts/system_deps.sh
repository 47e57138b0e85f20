#!/usr/bin/env bash
# System packages the tests need beyond Python: systemd-analyze (unit-file verification).
# Installed with apt when missing and running as root; otherwise the test that needs it says so.
set -euo pipefail
if command -v systemd-analyze >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing systemd (for systemd-analyze)" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi
