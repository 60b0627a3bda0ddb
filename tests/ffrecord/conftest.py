"""Fixtures of the FFRecord tests: seeded sample data and a FUSE mount (the per-test directory `d` is
tests/conftest.py's)."""

from __future__ import annotations

import random

import pytest


@pytest.fixture
def samples():
    """300 seeded samples of 0..4000 bytes (a few empty ones included)."""
    rng = random.Random(20261201)
    out = [rng.randbytes(rng.randrange(0, 4000)) for _ in range(300)]
    out[5] = out[6] = b""  # zero-length samples are legal
    return out


@pytest.fixture(scope="module")
def fuse_mnt(cluster, tmp_path_factory):
    """A FUSE mount of the shared cluster for one module (skips, with the reason, without FUSE)."""
    from threefs.client import fuse_mount

    reason = fuse_mount.fuse_unavailable_reason()
    if reason:
        pytest.skip(f"FUSE unavailable: {reason}")
    top = tmp_path_factory.mktemp("ffr-fuse")
    mnt = str(top / "mnt")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], str(top / "daemon.log"))
    yield mnt
    fuse_mount.stop(proc, mnt)
