#!/usr/bin/env bash
# Set up .venv and start a local threefs cluster in ./.threefs (foreground; Ctrl-C stops it).
# Extra arguments go to `threefs up` (e.g. --detach, --storage 3 --replicas 3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-system.sh"
bash "$root/scripts/setup-venv.sh"
exec "$root/.venv/bin/threefs" up "$@"
