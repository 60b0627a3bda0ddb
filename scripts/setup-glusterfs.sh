#!/usr/bin/env bash
# GlusterFS for benchmarks/mount_battery.py (the reference column of issue 15's mount battery).
# Not part of CI's setup-system.sh: it is a benchmark-only dependency (glusterd, bricks, FUSE client).
# Idempotent; Debian's packages (glusterfs-server 10.x, glusterfs-client).
set -euo pipefail
if command -v glusterd >/dev/null && command -v mount.glusterfs >/dev/null; then
    echo "GlusterFS is installed: $(glusterd --version | head -1)"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "run as root (apt-get install glusterfs-server glusterfs-client)" >&2
    exit 1
fi
echo "installing glusterfs-server and glusterfs-client from Debian ..."
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends glusterfs-server glusterfs-client
glusterd --version | head -1
