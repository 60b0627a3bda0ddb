"""Helpers shared by the FUSE tests (imported by conftest and the test modules)."""

from __future__ import annotations

import pytest

from threefs.client import fuse_mount


def require_fuse() -> None:
    reason = fuse_mount.fuse_unavailable_reason()
    if reason:
        pytest.skip(f"FUSE unavailable: {reason}")


stop_daemon = fuse_mount.stop  # unmount, wait, kill if needed: nothing left behind
