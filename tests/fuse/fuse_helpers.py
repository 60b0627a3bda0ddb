"""Helpers shared by the FUSE tests (imported by conftest and the test modules)."""

from __future__ import annotations

import signal

import pytest

from threefs.client import fuse_mount


def require_fuse() -> None:
    reason = fuse_mount.fuse_unavailable_reason()
    if reason:
        pytest.skip(f"FUSE unavailable: {reason}")


def stop_daemon(proc, mnt) -> None:
    """Unmount (the daemon then exits); never leave a mount or a process behind."""
    try:
        fuse_mount.unmount(mnt)
    finally:
        try:
            proc.wait(timeout=fuse_mount.UNMOUNT_TIMEOUT_S)
        except Exception:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=5)
            fuse_mount.unmount(mnt)
