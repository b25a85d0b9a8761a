#!/usr/bin/env bash
# Build a minimal Debian bookworm image for the tests' stand-ins of NGC's PyTorch image (containers/test-base.sh,
# containers/test-base-py312.sh): mmdebstrap's essential variant with PACKAGES, no docs, man pages or locales,
# merged /usr without usrmerge (and its perl, ~50 MB), dpkg without fsync (saves a fifth of the time, and stays on
# in the image, as in Docker's official images), then `podman import` as TAG. HOOK... are more mmdebstrap options
# (--customize-hook=...: "$1" in a hook is the chroot). One build of TAG at a time; nothing when TAG exists.
#
# Usage: containers/debian-image.sh TAG TITLE PACKAGES RECIPE [MMDEBSTRAP-OPTION...]
#   TITLE: the image's org.opencontainers.image.title; RECIPE: its runner.test-base.recipe label (what it holds).
set -euo pipefail
tag=${1:?usage: debian-image.sh TAG TITLE PACKAGES RECIPE [MMDEBSTRAP-OPTION...]}
title=$2 packages=$3 recipe=$4
shift 4
suite=bookworm

die() { printf '%s: %s\n' "$title" "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap chroots, the image goes to root's podman storage). HINT: sudo $0"
if ! command -v mmdebstrap >/dev/null || ! command -v podman >/dev/null; then
  die "podman or mmdebstrap missing. HINT: run scripts/install-podman.sh"
fi
podman image exists "$tag" && exit 0
# One build at a time: test sessions running side by side would each build and import it.
exec 9>"/run/lock/$title.lock"
flock 9
podman image exists "$tag" && exit 0

start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! mmdebstrap --variant=essential --format=tar --include="$packages" --dpkgopt=force-unsafe-io \
      --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' "$@" \
      "$suite" "$work/rootfs.tar" >"$work/log" 2>&1; then
  cat "$work/log" >&2
  die "mmdebstrap failed"
fi

podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL org.opencontainers.image.title=$title" \
  --change "LABEL runner.test-base.recipe=mmdebstrap:$suite:essential:$recipe" \
  --change 'CMD ["python3"]' \
  "$work/rootfs.tar" "$tag" >/dev/null

printf '%s: built %s in %ss\n' "$title" "$tag" "$((SECONDS - start))" >&2
