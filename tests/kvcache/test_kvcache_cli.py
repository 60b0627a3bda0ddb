"""`threefs kvcache ls / stats / clear` and the kvcache lines of `threefs status`, against a real cluster (the
CLI in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

from threefs.kvcache import KVCache

PAGE = 64 << 10


def _cli(cluster, *args):
    return subprocess.run([sys.executable, "-m", "threefs.cli.main", "--config", str(cluster.client_config_path),
                           *args], capture_output=True, text=True, timeout=120)


def test_kvcache_cli(fs, d, cluster, rng):
    root = f"{d}/cli"
    cache = KVCache(fs, root, page_bytes=PAGE, capacity_bytes=4 * PAGE)
    keys = [b"a", b"b", b"c", b"d", b"e", b"f"]
    # one batch larger than the cache: its head fills it, its tail finds no room (the head is reserved)
    assert cache.batch_put(keys, [rng.randbytes(PAGE) for _ in keys]) == [True] * 4 + [False] * 2
    assert cache.batch_put(keys[4:], [rng.randbytes(PAGE) for _ in keys[4:]]) == [True] * 2  # evicts a, b
    cache.batch_get_into([b"e", b"zz"], [bytearray(PAGE), bytearray(PAGE)])

    r = _cli(cluster, "kvcache", "ls")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(root))
    assert "4 pages" in line and "256.0 KiB / 256.0 KiB" in line and "50.0% of 2" in line and "evictions" in line

    r = _cli(cluster, "kvcache", "stats", root, "--json")
    stats = json.loads(r.stdout)
    assert stats["pages"] == 4 and stats["evictions"] >= 2 and stats["get_hits"] == 1 and stats["get_misses"] == 1

    r = _cli(cluster, "status")
    assert r.returncode == 0 and "kvcache:" in r.stdout and root in r.stdout, r.stdout[-2000:]

    r = _cli(cluster, "kvcache", "clear", root)
    assert r.returncode == 0 and "4 pages removed" in r.stdout, r.stderr
    assert cache.batch_exists([b"e"]) == 0 and cache.stats()["pages"] == 0

    r = _cli(cluster, "kvcache", "stats", f"{d}/nothing")
    assert r.returncode == 1 and "no kvcache at" in r.stderr

    r = _cli(cluster, "kvcache", "clear", "--drop", root)
    assert r.returncode == 0 and "dropped" in r.stdout
    assert not [n for n in fs.listdir(root) if n.startswith("data-")]
    again = KVCache(fs, root, page_bytes=4096, capacity_bytes=8 * 4096)  # a dropped root can be made anew
    assert again.page_bytes == 4096
