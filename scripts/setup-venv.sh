#!/usr/bin/env bash
# Create/refresh .venv in the repo root and install threefs (editable) with its test dependencies.
# Idempotent and quiet when nothing changed. Used by scripts/up.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.threefs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -U pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,bench]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import threefs, uvloop, msgspec, crc32c, awscrt, pytest" 
  touch "$stamp"
fi
# FUSE mount support: pyfuse3 compiles against libfuse3 (~50 s once; scripts/setup-system.sh installs
# libfuse3-dev). Without it the mount is unavailable and its tests skip saying why.
if ! .venv/bin/python -c "import pyfuse3" 2>/dev/null; then
  if pkg-config --exists fuse3 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[fuse]" 2>&1 | grep -v "^WARNING: Location" || true
  else
    echo "setup-venv: libfuse3-dev missing, skipping pyfuse3 (run scripts/setup-system.sh as root)" >&2
  fi
fi
