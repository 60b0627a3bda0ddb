"""Fixtures of the storage tests."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size (root only; unmounted afterwards): a disk that fills up."""
    mounted = []

    def mount(size: str):
        mount_point = tmp_path / f"tmpfs{len(mounted)}"
        mount_point.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                                capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {result.stderr.decode().strip()}")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
