"""The KV conformance harness: every engine in ENGINES runs every test that takes the `kv` fixture.

A later engine joins with one entry (an etcd entry would skip itself when no etcd server is reachable).
Tests are plain functions; `kv.run(body)` runs `await body(engine)` in a fresh event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from threefs.kv import KVEngine, open_engine
from threefs.kv.memory import MemoryEngine
from threefs.common.status import ThreeFSError
from threefs.kv.etcd import EtcdEngine
from threefs.kv.sqlite import SqliteEngine
from threefs.testing.etcd_cluster import shared_etcd, stop_shared_etcd


@dataclass(frozen=True)
class EngineSpec:
    url: Callable[[Path], str]
    # The same store opened with an injected clock (for MVCC-window tests); None if the engine cannot.
    with_clock: Callable[[Path, Callable[[], float]], KVEngine] | None
    durable: bool  # reopening the URL finds the data again


ENGINES: dict[str, EngineSpec] = {
    "memory": EngineSpec(
        url=lambda tmp: "memory://",
        with_clock=lambda tmp, clock: MemoryEngine(clock=clock),
        durable=False,
    ),
    "sqlite": EngineSpec(
        url=lambda tmp: f"sqlite:///{tmp}/db/kv.db",
        with_clock=lambda tmp, clock: SqliteEngine(f"{tmp}/db/kv.db", clock=clock),
        durable=True,
    ),
    # A real 3-member etcd cluster on loopback, started once per session; keys under a per-test prefix.
    "etcd": EngineSpec(
        url=lambda tmp: _etcd().kv_url(f"kvtest-{tmp.name}"),
        with_clock=lambda tmp, clock: EtcdEngine(_etcd().endpoints.split(","), f"kvtest-{tmp.name}", clock=clock),
        durable=True,
    ),
    # The same without the watch-kept replica: every read goes to etcd (the engine's other read path).
    "etcd-direct": EngineSpec(
        url=lambda tmp: _etcd().kv_url(f"kvdirect-{tmp.name}") + "?replica=off",
        with_clock=lambda tmp, clock: EtcdEngine(_etcd().endpoints.split(","), f"kvdirect-{tmp.name}",
                                                 clock=clock, replica=False),
        durable=True,
    ),
}


def _etcd():
    """The session's etcd cluster, started on first use; skips when etcd cannot run here."""
    try:
        return shared_etcd()
    except ThreeFSError as exc:
        pytest.skip(f"no etcd cluster: {exc}")


class FakeClock:
    """Seconds, moved only by the test."""

    def __init__(self, now_s: float = 1_700_000_000.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class KVHarness:
    def __init__(self, name: str, spec: EngineSpec, tmp_path: Path):
        self.name = name
        self.spec = spec
        self.tmp_path = tmp_path
        self.url = spec.url(tmp_path)

    async def open(self, clock: Callable[[], float] | None = None) -> KVEngine:
        if clock is None:
            return await open_engine(self.url)
        if self.spec.with_clock is None:
            pytest.skip(f"engine {self.name} takes no injected clock")
        return self.spec.with_clock(self.tmp_path, clock)

    def run(self, body: Callable[[KVEngine], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            engine = await self.open()
            try:
                return await body(engine)
            finally:
                await engine.close()

        return asyncio.run(main())


@pytest.fixture(params=list(ENGINES))
def kv(request: pytest.FixtureRequest, tmp_path: Path) -> KVHarness:
    return KVHarness(request.param, ENGINES[request.param], tmp_path)


@pytest.fixture(scope="session", autouse=True)
def _stop_etcd_at_end():
    yield
    stop_shared_etcd()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
