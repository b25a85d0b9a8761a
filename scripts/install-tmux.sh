#!/usr/bin/env bash
# Install tmux for the quickstart's terminal test (tests/test_quickstart_tmux.py runs scripts/quickstart.sh in a tmux
# pane as a person would, presses Ctrl-C and reads the screen).
#
# Quiet, idempotent, and fast when there is nothing to do. Prints nothing on success.
# Usage: scripts/install-tmux.sh
set -euo pipefail

die() { printf 'install-tmux: %s\n' "$*" >&2; exit 1; }

command -v tmux >/dev/null && exit 0
[ "$(id -u)" -eq 0 ] || die "needs root (it installs the tmux package). HINT: sudo $0"
command -v apt-get >/dev/null || die "no apt-get: install tmux with your package manager"
log=$(mktemp)
# Lock timeout: another session may be running apt on the same machine.
if ! { apt-get -qq -o DPkg::Lock::Timeout=300 update &&
       DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
         --no-install-recommends tmux; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  die "apt-get install tmux failed"
fi
rm -f "$log"
command -v tmux >/dev/null || die "tmux installed but not on PATH"
