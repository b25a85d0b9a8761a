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
packages=apt,python3,python3-pip,python-is-python3,python3-yaml,python3-jinja2,python3-requests

# shellcheck disable=SC2016  # "$1" in the customize hook is the chroot, expanded by mmdebstrap.
exec "$(dirname "$0")/debian-image.sh" "$tag" runner-test-base "$packages" "$packages" \
  --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED'
