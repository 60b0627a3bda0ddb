"""A client's synchronous metadata calls keep to one meta server (its KV read cache then holds the client's
working set), and move to another one when that one stops answering, staying there. Counted from the
servers' own request metrics (a real scrape), on a real cluster with two meta servers."""

from __future__ import annotations

import re
import urllib.request

from threefs.client.client import Client
from threefs.rpc.schemas.mgmtd import META
from threefs.testing.checks import stat_answers, wait_for

METAS = ("meta-1", "meta-2")


def _served(cluster, name: str, method: str = "meta.stat") -> float:
    text = urllib.request.urlopen(cluster.metrics_url(name), timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r'^threefs_rpc_requests_total\{(.*)\} ([0-9.e+-]+)$', line)
        if m and f'method="{method}"' in m.group(1):
            total += float(m.group(2))
    return total


def _scrapes(cluster, name: str) -> bool:
    try:
        _served(cluster, name)
        return True
    except OSError:
        return False


def _stats_per_server(cluster, fs, path: str, n: int, up: tuple[str, ...] = METAS) -> dict[str, float]:
    before = {name: _served(cluster, name) for name in up}
    for _ in range(n):
        assert fs.stat(path).length == 3
    return {name: _served(cluster, name) - before[name] for name in up}


def test_calls_keep_to_one_meta_server_and_move_when_it_dies(private_cluster):
    cluster = private_cluster(meta=2)
    fs = Client.connect(str(cluster.client_config_path))
    try:
        fs.write_bytes("/aff", b"abc")
        served = _stats_per_server(cluster, fs, "/aff", 40)
        assert sorted(served.values()) == [0, 40], served
        kept = next(name for name, n in served.items() if n == 40)
        other = next(name for name in METAS if name != kept)
        # a second client may keep to either; each keeps to one
        with Client.connect(str(cluster.client_config_path)) as fs2:
            assert sorted(_stats_per_server(cluster, fs2, "/aff", 20).values()) == [0, 20]

        cluster.kill(kept)
        wait_for(lambda: stat_answers(fs, "/aff"), f"calls failing over from {kept} to {other}", 60)
        assert _stats_per_server(cluster, fs, "/aff", 40, up=(other,)) == {other: 40}

        cluster.up()  # the dead one comes back: the client stays with the one that answered
        kept_id = 50 + int(kept.rsplit("-", 1)[1])
        wait_for(lambda: _scrapes(cluster, kept), f"{kept} serving metrics again", 60)
        wait_for(lambda: kept_id in {n.node_id for n in fs.aio.mgmtd.routing.nodes_of_type(META)},
                 f"{kept} back in the client's routing", 60)
        assert _stats_per_server(cluster, fs, "/aff", 40) == {kept: 0, other: 40}
        fs.remove("/aff")
        assert not fs.exists("/aff")
    finally:
        fs.close()


def test_async_calls_keep_to_one_meta_server_and_move_when_it_dies(private_cluster):
    """The event loop's path (the FUSE daemon, the S3 gateway, the asyncio API) keeps to one server as the
    thread path does: alternating made each server find the other's commit in the shared SQLite file and
    drop its caches (mount create+close / unlink: ~385 -> ~290 us of meta CPU each)."""
    cluster = private_cluster(meta=2)
    fs = Client.connect(str(cluster.client_config_path))
    try:
        fs.write_bytes("/aaff", b"abc")

        def stats(n: int, up: tuple[str, ...] = METAS) -> dict[str, float]:
            before = {name: _served(cluster, name) for name in up}
            for _ in range(n):
                assert fs.run(fs.aio.stat("/aaff")).length == 3
            return {name: _served(cluster, name) - before[name] for name in up}

        served = stats(40)
        assert sorted(served.values()) == [0, 40], served
        kept = next(name for name, n in served.items() if n == 40)
        other = next(name for name in METAS if name != kept)
        cluster.kill(kept)
        wait_for(lambda: stat_answers(fs, "/aaff"), f"calls failing over from {kept} to {other}", 60)
        assert stats(40, up=(other,)) == {other: 40}
        fs.remove("/aaff")
    finally:
        fs.close()
