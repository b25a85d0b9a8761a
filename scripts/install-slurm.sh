#!/bin/sh
# Install what runner/devcluster.py needs for a local multi-node Slurm cluster (Debian 12, as root).
# Idempotent: does nothing (and is fast) when everything is already installed.
set -eu

PKGS="slurmctld slurmd slurm-client munge slurmdbd mariadb-server iproute2 iptables util-linux procps"

if [ "$(id -u)" -ne 0 ]; then
    echo "install-slurm.sh: must run as root (try: sudo $0)" >&2
    exit 1
fi

missing=""
for p in $PKGS; do
    if ! dpkg -s "$p" >/dev/null 2>&1; then
        missing="$missing $p"
    fi
done

if [ -z "$missing" ]; then
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Keep the package scripts from starting system-wide daemons: the dev cluster starts its own.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created_policy=1
fi
cleanup() { [ "$created_policy" -eq 1 ] && rm -f "$policy"; return 0; }
trap cleanup EXIT

echo "install-slurm.sh: installing:$missing" >&2
# shellcheck disable=SC2086
if ! apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

for c in slurmctld slurmd slurmdbd sbatch munged mariadbd nsenter unshare ip tc; do
    if ! command -v "$c" >/dev/null 2>&1; then
        echo "install-slurm.sh: $c still missing after install" >&2
        exit 1
    fi
done
