#!/usr/bin/env bash
# Install etcd (server and etcdctl) for the etcd KV engine and its tests. Idempotent: does nothing when etcd
# is present. Needs root and apt; without them it says so and carries on, and the etcd tests skip with that
# reason. Called by scripts/test.sh. No systemd here: tests start etcd themselves (threefs/testing/etcd_cluster.py).
set -euo pipefail
if command -v etcd >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "setup-etcd: etcd is missing (apt-get install etcd-server etcd-client as root); etcd tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q etcd-server etcd-client >/dev/null 2>&1; then
  apt-get update -q >/dev/null
  apt-get install -y -q etcd-server etcd-client >/dev/null || { echo "setup-etcd: install failed" >&2; exit 0; }
fi
echo "setup-etcd: installed etcd-server etcd-client"
