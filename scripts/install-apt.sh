#!/usr/bin/env bash
# Install Debian packages a test needs, when the command they provide is missing. Quiet, idempotent, and fast when
# there is nothing to do; prints nothing on success. No recommends (fonts and desktop integration are not needed).
# Usage: scripts/install-apt.sh COMMAND PACKAGE...   (scripts/install-chromium.sh, scripts/install-tmux.sh)
#        scripts/install-apt.sh - PACKAGE...         (no command to look for: install them; scripts/install-podman.sh)
set -euo pipefail
cmd=${1:?usage: install-apt.sh COMMAND PACKAGE...}
shift
die() { printf 'install-%s: %s\n' "${cmd/#-/apt}" "$*" >&2; exit 1; }

[ "$cmd" != - ] && command -v "$cmd" >/dev/null && exit 0
[ "$(id -u)" -eq 0 ] || die "needs root (it installs $*). HINT: sudo $0 $cmd $*"
command -v apt-get >/dev/null || die "no apt-get: install $* with your package manager"
log=$(mktemp)
# Lock timeout: another session may be running apt on the same machine.
if ! { apt-get -qq -o DPkg::Lock::Timeout=300 update &&
       DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
         --no-install-recommends "$@"; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  die "apt-get install $* failed"
fi
rm -f "$log"
[ "$cmd" = - ] || command -v "$cmd" >/dev/null || die "$* installed but $cmd is not on PATH"
