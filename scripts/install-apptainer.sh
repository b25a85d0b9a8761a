#!/usr/bin/env bash
# Install Apptainer from its own Go module source (github.com/apptainer/apptainer at the pinned version) into
# /usr/local, with the Debian packages its INSTALL.md lists plus what unprivileged SIF mounts use (squashfuse,
# fuse2fs, fuse-overlayfs). Neither Debian 12 nor PyPI carries Apptainer; the Go module proxy and Go >= 1.25.7 do.
#
# On a real cluster you do not run this: use your site's Apptainer (or Singularity). runner needs only `apptainer`
# (or `singularity`) on PATH where `runner build` makes the SIF and where the ranks start.
#
# Root, quiet, idempotent: under a second when the pinned version is already installed. The source, the Go module
# cache and the finished install tree are cached under $RUNNER_APPTAINER_CACHE (default /var/cache/runner-apptainer,
# outside any checkout) keyed by version, so a second clone on the same machine, or CI, installs without rebuilding.
# Build: about 5 minutes on 2 cores; install from the cache: about 2 s.
#
# Usage: scripts/install-apptainer.sh
set -euo pipefail
VERSION=1.5.3
CACHE=${RUNNER_APPTAINER_CACHE:-/var/cache/runner-apptainer}
PREFIX=/usr/local
die() { printf 'install-apptainer: %s\n' "$*" >&2; exit 1; }

# Apptainer gives root's containers every capability ("root default capabilities = full") and its starter refuses
# to start where the bounding set lacks one (sandboxed machines, like this project's, drop CAP_SYS_RESOURCE): there,
# root's containers get the capability file's set (none unless granted), which is what every other user gets.
fit_capabilities() {
  local conf=$PREFIX/etc/apptainer/apptainer.conf bnd last
  bnd=$(awk '/^CapBnd:/ {print $2}' /proc/self/status)
  last=$(cat /proc/sys/kernel/cap_last_cap)
  if [ "$((16#$bnd))" -ne "$(( (1 << (last + 1)) - 1 ))" ] && grep -q '^root default capabilities = full$' "$conf"; then
    sed -i 's/^root default capabilities = full$/root default capabilities = file/' "$conf"
  fi
}

# A user mounts a SIF with squashfuse through /dev/fuse; udev gives it mode 0666 on a stock host (fuse3's rule), a
# machine with a static /dev may keep root's 0600, and then only root could run an image.
fit_fuse() {
  [ ! -c /dev/fuse ] || [ "$(stat -c %a /dev/fuse)" = 666 ] || chmod 0666 /dev/fuse
}

if [ "$(apptainer version 2>/dev/null)" = "$VERSION" ]; then fit_capabilities; fit_fuse; exit 0; fi
[ "$(id -u)" -eq 0 ] || die "needs root (it installs packages and $PREFIX/bin/apptainer). HINT: sudo $0"
command -v go >/dev/null || die "no go on PATH: Apptainer $VERSION builds with Go >= 1.25.7"

# Build packages (INSTALL.md) and the tools Apptainer runs: mksquashfs/unsquashfs, squashfuse_ll and fuse2fs for
# mounting images as a non-root user, fuse-overlayfs, newuidmap for --fakeroot, cryptsetup for encrypted images,
# openssl for the PEM keys of container.sign_key/verify_key (`openssl genpkey -algorithm ed25519`; not in a minimal
# Debian).
"$(dirname "$0")/install-apt.sh" - build-essential pkg-config libseccomp-dev libtalloc-dev libattr1-dev \
  libprotobuf-c-dev libsubid-dev uidmap fakeroot cryptsetup squashfs-tools squashfuse fuse2fs fuse-overlayfs \
  libfuse3-dev openssl

tree=$CACHE/$VERSION
if [ ! -e "$tree/.done" ]; then
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  export GOMODCACHE=$CACHE/gomod GOFLAGS=-modcacherw GOTOOLCHAIN=local
  src=$CACHE/src-$VERSION
  (
    dir=$(go mod download -json "github.com/apptainer/apptainer@v$VERSION" |
          sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
    [ -n "$dir" ] || die "go mod download gave no source directory for apptainer v$VERSION"
    rm -rf "$src" "$tree"
    cp -r "$dir" "$src"
    chmod -R u+w "$src"
    # The module zip keeps no file modes: every script of the build (mconfig, mlocal/scripts, makeit) lost its x bit.
    grep -rlI '^#!' "$src" --exclude='*.go' | xargs chmod +x
    echo "$VERSION" >"$src/VERSION"  # what a release tarball carries; mconfig reads it instead of git
    (cd "$src" && ./mconfig -b builddir --prefix="$PREFIX" && make -C builddir -j"$(nproc)" &&
       make -C builddir install DESTDIR="$tree")
  ) >"$log" 2>&1 || { tail -n 40 "$log" >&2; die "building apptainer $VERSION failed (log above)"; }
  rm -rf "$src"
  touch "$tree/.done"
fi
cp -a "$tree$PREFIX/." "$PREFIX/"
fit_capabilities
fit_fuse
[ "$(apptainer version 2>/dev/null)" = "$VERSION" ] || die "installed, but 'apptainer version' does not say $VERSION"
