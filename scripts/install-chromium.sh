#!/usr/bin/env bash
# Install Debian's chromium for the report page's browser test (tests/test_report.py opens the page headless).
#
# Quiet, idempotent, and fast when there is nothing to do. Prints nothing on success.
# Usage: scripts/install-chromium.sh
set -euo pipefail

die() { printf 'install-chromium: %s\n' "$*" >&2; exit 1; }

command -v chromium >/dev/null && exit 0
[ "$(id -u)" -eq 0 ] || die "needs root (it installs the chromium package). HINT: sudo $0"
command -v apt-get >/dev/null || die "no apt-get: install chromium with your package manager"
log=$(mktemp)
# Lock timeout: another session may be running apt on the same machine. No recommends: fonts and
# desktop integration are not needed headless (fonts-liberation gives the screenshot readable text).
if ! { apt-get -qq -o DPkg::Lock::Timeout=300 update &&
       DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
         --no-install-recommends chromium fonts-liberation; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  die "apt-get install chromium failed"
fi
rm -f "$log"
command -v chromium >/dev/null || die "chromium installed but not on PATH"
