#!/usr/bin/env bash
# A STAND-IN for the NGC PyTorch image with Python 3.12 (NGC's 24.xx+ images ship 3.12; Debian 12's is 3.11), for
# the ESPnet3 image (examples/espnet3-mini-an4/podman.yaml): Debian bookworm with pyenv's CPython 3.12.1 copied into
# /usr/local (`python`, `python3`, `python3.12`, `pip` are 3.12; libpython in /usr/local/lib, which ld.so searches)
# and the Debian libraries its extension modules link. No torch, no CUDA; built offline from this machine's pyenv.
#
# What it does not reproduce: NGC's CUDA, NCCL, HPC-X and its own torch build (the ESPnet3 image installs PyPI's
# torch 2.11, a CUDA build that runs on the CPU), NGC's PIP_CONSTRAINT, and a Python built for /usr/local (this one
# was built for pyenv's prefix: its sysconfig's compiler flags still name it; nothing here compiles). No
# Debian python3, no tkinter libraries, no test suite (lib/python3.12/test).
#
# Needs root, podman, mmdebstrap and deb.debian.org, like containers/test-base.sh, and a CPython 3.12 built with
# --enable-shared under PY312_PREFIX (default: pyenv's /root/.pyenv/versions/3.12.1, on these machines and CI's).
# Usage: containers/test-base-py312.sh [TAG]    (does nothing when the image exists)
set -euo pipefail

tag=${1:-localhost/runner-test-base:bookworm-py312}
prefix=${PY312_PREFIX:-/root/.pyenv/versions/3.12.1}
packages=apt,ca-certificates,libssl3,libffi8,libsqlite3-0,liblzma5,libbz2-1.0,libncursesw6,libreadline8,libuuid1,libnsl2,libexpat1

die() { printf 'test-base-py312: %s\n' "$*" >&2; exit 1; }

podman image exists "$tag" 2>/dev/null && exit 0
[ -x "$prefix/bin/python3.12" ] && [ -e "$prefix/lib/libpython3.12.so.1.0" ] \
  || die "no shared CPython 3.12 under $prefix. HINT: set PY312_PREFIX (a prefix built with --enable-shared)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Only the interpreter, its stdlib and pip: not the test suite, nor what else this machine put in its site-packages.
tar -C "$prefix" -cf "$work/python.tar" --exclude=./lib/python3.12/test --exclude='*/idlelib' \
  --exclude='*/tkinter' --exclude='./lib/python3.12/lib-dynload/_tkinter*' --exclude='*.pth' \
  ./bin ./lib/libpython3.12.so ./lib/libpython3.12.so.1.0 ./lib/python3.12 ./include

# The scripts' shebangs name pyenv's prefix: they name /usr/local's python3.12 in the image.
# shellcheck disable=SC2016  # "$1" in the hooks is the chroot, expanded by mmdebstrap.
"$(dirname "$0")/debian-image.sh" "$tag" runner-test-base-py312 "$packages" "$packages+$prefix" \
  --customize-hook="tar -C \"\$1/usr/local\" -xf $work/python.tar" \
  --customize-hook="sed -i '1s|^#!$prefix/bin/python3.12|#!/usr/local/bin/python3.12|' \"\$1\"/usr/local/bin/*" \
  --customize-hook='chroot "$1" ldconfig' \
  --customize-hook='chroot "$1" python3.12 -c "import ssl, ctypes, sqlite3, lzma, bz2, pip"'
