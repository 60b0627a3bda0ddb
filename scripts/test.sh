#!/usr/bin/env bash
# Set up .venv and run the whole test suite (real processes, real TCP, real SQLite).
# Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup-system.sh"
bash "$root/scripts/setup-etcd.sh"
bash "$root/scripts/setup-venv.sh"
cd "$root"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
