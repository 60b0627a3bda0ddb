#!/usr/bin/env bash
# Install the system packages the tests and benchmarks need: fuse3 (fusermount3), libfuse3-dev and
# pkg-config (to build pyfuse3), redis-server and nginx-light (benchmark baselines), rsync and sqlite3
# (programs the FUSE tests run on the mount).
# Idempotent: does nothing when they are present. Needs root (CI and dev machines are);
# without root it says what to install and carries on, and the FUSE tests skip with that reason.
# Called by scripts/test.sh and scripts/up.sh before scripts/setup-venv.sh.
set -euo pipefail
missing=()
command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || missing+=(libfuse3-dev)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)  # the Redis baselines of the benchmarks
# [s3] benchmarks/s3.py serves the same bytes with nginx as its reference
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)
# programs tests/fuse/test_fuse_programs.py runs on the mount (it skips those that are missing)
command -v rsync >/dev/null 2>&1 || missing+=(rsync)
command -v sqlite3 >/dev/null 2>&1 || missing+=(sqlite3)
# [client_io] benchmarks/client_io.py's FUSE random-read rows (it skips them without fio)
command -v fio >/dev/null 2>&1 || missing+=(fio)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-system: FUSE support (and the Redis baseline) need: ${missing[*]} (install them as root); continuing without" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or stale on a fresh machine: update only when the install fails.
if ! apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q "${missing[@]}" >/dev/null
fi
echo "setup-system: installed ${missing[*]}"
