"""Fixtures of the client tests: a fresh directory per test on the shared cluster."""

from __future__ import annotations

import pytest


@pytest.fixture
def d(fs, request):
    """A directory of this test's own on the shared cluster (named after the test)."""
    name = request.node.name.replace("[", "_").replace("]", "").replace("/", "_")
    path = f"/{request.module.__name__.rsplit('.', 1)[-1]}-{name}"
    fs.mkdir(path)
    return path
