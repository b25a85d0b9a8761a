#!/usr/bin/env bash
# Build the local image that stands in for the NGC PyTorch image in tests (nvcr.io is not reachable
# from test machines): Debian bookworm with python3, pip, and the runner's runtime dependencies as
# Debian packages, so that builds FROM it need no network. Does nothing when the image exists.
#
# Like the NGC image it has bash, apt, `python` and `pip`, and pip may install into the system Python
# (Debian's PEP 668 marker is removed). No docs, man pages or locales: ~150 MB (apt is 18 MB of it,
# pip 22 MB; both are there because the rendered Dockerfile may use them).
#
# Needs root, podman and mmdebstrap (scripts/install-podman.sh) and access to deb.debian.org.
# Usage: containers/test-base.sh [TAG]    (scripts/make-base-image.sh calls it)
set -euo pipefail

tag=${1:-localhost/runner-test-base:bookworm}
suite=bookworm
packages=apt,python3,python3-pip,python-is-python3,python3-yaml,python3-jinja2,python3-requests

die() { printf 'make-base-image: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap chroots, the image goes to root's podman storage). HINT: sudo $0"
if ! command -v mmdebstrap >/dev/null || ! command -v podman >/dev/null; then
  die "podman or mmdebstrap missing. HINT: run scripts/install-podman.sh"
fi

podman image exists "$tag" && exit 0
# One build at a time: test sessions running side by side would each build and import it.
exec 9>"/run/lock/runner-test-base.lock"
flock 9
podman image exists "$tag" && exit 0

start=$SECONDS
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The merged-usr hook keeps usrmerge (and with it perl, ~50 MB) out of the image; dpkg without
# fsync saves a fifth of the time (and stays on in the image, as in Docker's official images).
# shellcheck disable=SC2016  # "$1" in the customize hook is the chroot, expanded by mmdebstrap.
if ! mmdebstrap --variant=essential --format=tar --include="$packages" --dpkgopt=force-unsafe-io \
      --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED' \
      "$suite" "$work/rootfs.tar" >"$work/log" 2>&1; then
  cat "$work/log" >&2
  die "mmdebstrap failed"
fi

podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'LABEL org.opencontainers.image.title=runner-test-base' \
  --change "LABEL runner.test-base.recipe=mmdebstrap:$suite:essential:$packages" \
  --change 'CMD ["python3"]' \
  "$work/rootfs.tar" "$tag" >/dev/null

printf 'make-base-image: built %s in %ss\n' "$tag" "$((SECONDS - start))" >&2
