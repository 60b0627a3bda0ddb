"""Fixtures for the meta tests: each test runs against the memory and the sqlite engine."""

import pytest
from meta_helpers import MetaEnv


@pytest.fixture(params=["memory", "sqlite"])
def meta(request, tmp_path) -> MetaEnv:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/m.db"
    return MetaEnv(url)
