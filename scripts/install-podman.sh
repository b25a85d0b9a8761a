#!/usr/bin/env bash
# Install podman for root on Debian/Ubuntu and make it work on this machine (plus mmdebstrap, which makes the
# tests' local base image).
#
# Quiet, idempotent, and fast when there is nothing to do (~50 ms). Prints nothing on success.
# After a change (packages installed, settings written), or with --verify, it proves that podman
# can build and run a container (~2 s, offline).
#
# Besides the packages it writes at most one file, /etc/containers/containers.conf.d/50-runner.conf,
# and only with the settings this machine needs (a drop-in adds keys to the distribution's
# configuration; CONTAINERS_CONF would replace all of it and be lost on every shell without the
# variable). On a machine where podman works as installed, no file is written (an old one is removed).
#
# Usage: scripts/install-podman.sh [--verify]
set -euo pipefail

changed=0
[ "${1:-}" = --verify ] && changed=1

conf_file=/etc/containers/containers.conf.d/50-runner.conf
packages=(podman runc mmdebstrap)

die() { printf 'install-podman: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (it installs packages and writes $conf_file). HINT: sudo $0"

install_packages() {
  local missing=() pkg
  for pkg in "${packages[@]}"; do
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null)" = installed ] || missing+=("$pkg")
  done
  [ "${#missing[@]}" -eq 0 ] && return 0
  changed=1
  # No recommends (install-apt.sh): buildah, fuse-overlayfs, slirp4netns and uidmap serve rootless use only.
  "$(dirname "$0")/install-apt.sh" - "${missing[@]}"
}

# Prints the containers.conf settings this machine needs; nothing when it needs none.
needed_settings() {
  # Rootful podman gives each container nofile and nproc limits of 1048576, and the runtime fails
  # with "setrlimit RLIMIT_NOFILE: Operation not permitted" where even root may not raise a hard
  # limit (sandboxed machines). Then stay within what podman itself has: the current hard nofile,
  # and nproc at most 32768 (podman lowers its own RLIMIT_NPROC to that; strace shows it).
  if ! (ulimit -Hn 1048576 && ulimit -Hu 1048576) 2>/dev/null; then
    local nofile nproc
    nofile=$(ulimit -Hn)
    nproc=$(ulimit -Hu)
    [ "$nofile" = unlimited ] && nofile=1048576
    if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
    printf '[containers]\n'
    printf '# This machine refuses to raise hard rlimits, even for root.\n'
    printf 'default_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' "$nofile" "$nofile" "$nproc" "$nproc"
  fi
  # podman prefers crun when it is installed; crun 1.8 refuses cgroup v1 with a v2 hierarchy
  # mounted next to it ("cgroups in hybrid mode not supported"). runc works there.
  if command -v crun >/dev/null && [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" != cgroup2fs ] &&
     [ "$(stat -fc %T /sys/fs/cgroup/unified 2>/dev/null)" = cgroup2fs ]; then
    printf '[engine]\n'
    printf '# crun does not support the hybrid cgroup layout of this machine.\n'
    printf 'runtime = "runc"\n'
  fi
}

write_conf() {
  local want
  want=$(needed_settings)
  if [ -z "$want" ]; then
    if [ -e "$conf_file" ]; then rm -f "$conf_file"; changed=1; fi
    return 0
  fi
  want="# Written by scripts/install-podman.sh (runner): podman settings this machine needs.
$want"
  if [ "$(cat "$conf_file" 2>/dev/null)" != "$want" ]; then
    mkdir -p "${conf_file%/*}"
    printf '%s\n' "$want" >"$conf_file"
    changed=1
  fi
}

# A tiny offline build and run: FROM scratch plus ldconfig, which glibc ships statically linked
# (Ubuntu as ldconfig.real), so no registry and no base image are needed.
verify() {
  local tag="localhost/runner-podman-probe:$$" out rc=0
  podman info >/dev/null 2>&1 || die "podman info failed: $(podman info 2>&1 | tail -n 1)"
  probe_dir=$(mktemp -d)
  trap 'rm -rf "$probe_dir"' EXIT
  cp "$( [ -x /sbin/ldconfig.real ] && echo /sbin/ldconfig.real || echo /sbin/ldconfig)" "$probe_dir/probe"
  printf 'FROM scratch\nCOPY probe /probe\nRUN ["/probe", "--version"]\n' >"$probe_dir/Containerfile"
  out=$({ podman build -q --layers=false --no-cache -t "$tag" "$probe_dir" &&
          podman run --rm "$tag" /probe --version; } 2>&1) || rc=$?
  podman rmi -f "$tag" >/dev/null 2>&1 || true
  [ "$rc" -eq 0 ] || die "podman cannot build or run a container here:
$(printf '%s' "$out" | tail -n 5)"
}

install_packages
write_conf
if [ "$changed" -eq 1 ]; then verify; fi
