"""Fixtures of the checkpoint tests: a fresh directory per test on the shared cluster."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # the `ml` extra: scripts/setup-venv.sh installs it


@pytest.fixture
def d(fs, request):
    name = request.node.name.replace("[", "_").replace("]", "").replace("/", "_")
    path = f"/ckpt-{request.module.__name__.rsplit('.', 1)[-1]}-{name}"
    fs.mkdir(path)
    return path
