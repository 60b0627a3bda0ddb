"""KVCache through a real cluster (`threefs up`'s kvcache-1 service): put/get/exists/delete into bytearray,
numpy and torch buffers, prefix lookups, keys, eviction within the capacity, a Zipf trace against an exact
LRU simulation, bad input, and threefs permissions on the cache root."""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch

from threefs.common.status import StatusCode, ThreeFSError
from threefs.kvcache import KVCache, page_keys
from threefs.kvcache.keys import namespace_tag

PAGE = 64 << 10


def pages(rng, n: int, size: int = PAGE) -> list[bytes]:
    return [rng.randbytes(size) for _ in range(n)]


def test_page_keys_are_sglang_chained_sha256():
    tokens = list(range(200))
    keys = page_keys(tokens, page_tokens=64, namespace=namespace_tag("llama", 1, 2))
    assert len(keys) == 3  # the partial last page (8 tokens) has no key
    prior = None
    for i, key in enumerate(keys):  # SGLang's get_hash_str: sha256(prior digest || u32 LE tokens)
        h = hashlib.sha256()
        if prior:
            h.update(prior)
        for t in tokens[64 * i:64 * (i + 1)]:
            h.update(struct.pack("<I", t))
        prior = h.digest()
        assert key == prior + b"|llama/tp1of2"
    assert page_keys(tokens[:128], 64, "llama/tp1of2") == keys[:2]  # a prefix has the prefix's keys
    assert page_keys(tokens, 64, "other")[0] != keys[0]
    with pytest.raises(ThreeFSError) as info:
        page_keys([-1] * 64)
    assert info.value.code == StatusCode.INVALID_ARGUMENT


def test_roundtrip_into_bytearray_numpy_torch(fs, d, rng):
    cache = KVCache(fs, f"{d}/c", page_bytes=PAGE, capacity_bytes=64 * PAGE)
    keys = page_keys(range(64 * 12), 64, "m")
    data = pages(rng, 12)
    assert cache.batch_put(keys, data) == [True] * 12
    assert cache.batch_put(keys[:2], data[:2]) == [True, True]  # already there: stored, not rewritten
    into_bytes = [bytearray(PAGE) for _ in range(4)]
    into_np = [np.empty(PAGE, dtype=np.uint8) for _ in range(4)]
    into_torch = [torch.empty(PAGE // 2, dtype=torch.bfloat16) for _ in range(4)]
    assert cache.batch_get_into(keys[:4], into_bytes) == [PAGE] * 4
    assert cache.batch_get_into(keys[4:8], into_np) == [PAGE] * 4
    assert cache.batch_get_into(keys[8:], into_torch) == [PAGE] * 4
    assert [bytes(b) for b in into_bytes] == data[:4]
    assert [a.tobytes() for a in into_np] == data[4:8]
    assert [t.view(torch.uint8).numpy().tobytes() for t in into_torch] == data[8:]
    stats = cache.stats()
    assert stats["pages"] == 12 and stats["get_hits"] == 12 and stats["put_exists"] == 2
    cache.close()


def test_exists_is_the_cached_prefix_and_delete(fs, d, rng):
    cache = KVCache(fs, f"{d}/c", page_bytes=PAGE, capacity_bytes=32 * PAGE)
    keys = page_keys(range(64 * 8), 64, "m")
    data = pages(rng, 8)
    assert cache.batch_exists(keys) == 0
    cache.batch_put(keys[:5], data[:5])
    assert cache.batch_exists(keys) == 5
    assert cache.delete([keys[2], b"absent"]) == 1
    assert cache.batch_exists(keys) == 2
    out = [bytearray(PAGE) for _ in keys]
    assert cache.batch_get_into(keys, out) == [PAGE, PAGE, -1, PAGE, PAGE, -1, -1, -1]
    short = [bytearray(1000)]  # pages shorter than page_bytes keep their length
    cache.batch_put([b"short"], [data[0][:1000]])
    assert cache.batch_get_into([b"short"], short) == [1000] and bytes(short[0]) == data[0][:1000]


def test_two_clients_share_a_cache(fs, cluster, d, rng):
    from threefs.client.client import Client

    a = KVCache(fs, f"{d}/c", page_bytes=PAGE, capacity_bytes=32 * PAGE)
    with Client.connect(str(cluster.client_config_path)) as fs2:
        b = KVCache(fs2, f"{d}/c", page_bytes=0, capacity_bytes=0)  # 0: take the existing cache's
        assert (b.page_bytes, b.capacity_bytes) == (PAGE, 32 * PAGE)
        keys, data = [b"k%d" % i for i in range(6)], pages(rng, 6)
        assert a.batch_put(keys, data) == [True] * 6
        out = [bytearray(PAGE) for _ in keys]
        assert b.batch_get_into(keys, out) == [PAGE] * 6 and [bytes(o) for o in out] == data
        b.close()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_service_is_reached_over_its_unix_socket_on_this_host_or_tcp(fs, d, rng, monkeypatch, transport):
    """kvcache-1 runs on this host: a client reaches it through its Unix socket (threefs/common/local_socket.py),
    or over TCP with THREEFS_RPC_LOCAL=0; the answers are the same."""
    import socket

    monkeypatch.setenv("THREEFS_RPC_LOCAL", "1" if transport == "unix" else "0")
    cache = KVCache(fs, f"{d}/c", page_bytes=PAGE, capacity_bytes=8 * PAGE)
    try:
        assert cache._meta._sock.family == (socket.AF_UNIX if transport == "unix" else socket.AF_INET)
        keys, data = [b"u%d" % i for i in range(3)], pages(rng, 3)
        assert cache.batch_put(keys, data) == [True] * 3
        assert cache.batch_exists(keys + [b"absent"]) == 3
    finally:
        cache.close()


def test_eviction_keeps_space_within_capacity(fs, d, rng):
    slots = 20
    cache = KVCache(fs, f"{d}/c", page_bytes=PAGE, capacity_bytes=slots * PAGE)
    keys = [b"key-%03d" % i for i in range(100)]
    data = pages(rng, 100)
    for i in range(0, 100, 10):
        assert cache.batch_put(keys[i:i + 10], data[i:i + 10]) == [True] * 10
        s = cache.stats()
        assert s["used_bytes"] <= s["capacity_bytes"] == slots * PAGE and s["pages"] <= slots
    s = cache.stats()
    assert s["evictions"] >= 80
    out = [bytearray(PAGE) for _ in keys]
    got = cache.batch_get_into(keys, out)
    present = [i for i, n in enumerate(got) if n == PAGE]
    assert present and min(present) >= 80 - 1, "the least recently used pages go first"
    assert all(bytes(out[i]) == data[i] for i in present)
    # the data files never grow: slots are reused
    total = sum(fs.stat(f"{d}/c/{n}").length for n in fs.listdir(f"{d}/c") if n.startswith("data-"))
    assert total == slots * cache.stride


def _lru_hits(trace: list[int], capacity: int) -> int:
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for k in trace:
        if k in lru:
            hits += 1
            lru.move_to_end(k)
        else:
            lru[k] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
    return hits


def test_zipf_trace_hit_rate_close_to_exact_lru(fs, d):
    rng = np.random.default_rng(20261201)
    key_space, slots, n = 1000, 100, 3000  # capacity 10x smaller than the key space
    trace = [int(x) % key_space for x in rng.zipf(1.2, n)]
    page = 4096
    cache = KVCache(fs, f"{d}/z", page_bytes=page, capacity_bytes=slots * page)
    payload = {k: k.to_bytes(4, "little") * (page // 4) for k in set(trace)}
    hits, batch = 0, 8
    bufs = [bytearray(page) for _ in range(batch)]
    for i in range(0, n, batch):
        part = trace[i:i + batch]
        keys = [b"z%d" % k for k in part]
        got = cache.batch_get_into(keys, bufs[:len(part)])
        for k, g, b in zip(part, got, bufs):
            if g >= 0:
                hits += 1
                assert bytes(b) == payload[k]
        misses = [j for j, g in enumerate(got) if g < 0]
        cache.batch_put([keys[j] for j in misses], [payload[part[j]] for j in misses])
        assert cache.stats()["pages"] <= slots
    exact = _lru_hits(trace, slots)
    assert hits >= 0.95 * exact, f"hit rate {hits / n:.3f} vs exact LRU {exact / n:.3f}"
    s = cache.stats()
    assert s["used_bytes"] <= slots * page and s["evictions"] > 0


def test_bad_input_is_refused_with_a_clear_error(fs, d, rng):
    cache = KVCache(fs, f"{d}/c", page_bytes=PAGE, capacity_bytes=8 * PAGE)
    cases = [
        (lambda: cache.batch_put([b"a"], [b"x" * (PAGE + 1)]), "hold 1.."),
        (lambda: cache.batch_put([b"a", b"b"], [b"x"]), "2 keys but 1 buffers"),
        (lambda: cache.batch_put(["str-key"], [b"x"]), "a key is"),
        (lambda: cache.batch_get_into([b"a"], [b"read-only"]), "writable"),
        (lambda: KVCache(fs, f"{d}/c", page_bytes=4096, capacity_bytes=8 * PAGE), "exists with page_bytes"),
        (lambda: KVCache(fs, "relative", page_bytes=PAGE), "absolute path"),
        (lambda: KVCache(fs, f"{d}/none", page_bytes=PAGE, create=False), "no kvcache"),
    ]
    for fn, text in cases:
        with pytest.raises(ThreeFSError) as info:
            fn()
        assert text in str(info.value), str(info.value)
    cache.batch_put([b"a"], [b"ok"])  # nothing was lost on the way
    out = [bytearray(2)]
    assert cache.batch_get_into([b"a"], out) == [2] and out[0] == b"ok"
    big = [bytearray(PAGE)]
    cache.batch_put([b"big"], [bytes(PAGE)])
    with pytest.raises(ThreeFSError, match="holds 100 bytes"):
        cache.batch_get_into([b"big"], [bytearray(100)])
    del big


def test_threefs_permissions_decide_who_reads_and_writes(fs, cluster, d, rng):
    from threefs.client.client import Client
    from threefs.common.config import ClientConfig, load_toml
    from threefs.rpc.schemas import mgmtd as ms

    def user_client(name: str, uid: int) -> Client:
        rsp = fs.run(fs.aio.mgmtd.call("user_add", ms.UserReq(name, uid, uid), ms.UserTokenRsp))
        base = load_toml(cluster.client_config_path, ClientConfig)
        return Client.connect(ClientConfig(mgmtd=base.mgmtd, token=rsp.token))

    root = f"{d}/private"
    fs.mkdir(root, 0o755)
    fs.chown(root, uid=4101, gid=4101)
    alice, bob = user_client("kv-alice", 4101), user_client("kv-bob", 4102)
    try:
        fs.chmod(d, 0o777)
        owner = KVCache(alice, root, page_bytes=PAGE, capacity_bytes=8 * PAGE)  # the owner creates it
        assert owner.writable and owner.batch_put([b"k"], [b"secret"]) == [True]
        reader = KVCache(bob, root, page_bytes=PAGE, capacity_bytes=8 * PAGE)  # 0755: others may read
        assert not reader.writable
        out = [bytearray(6)]
        assert reader.batch_get_into([b"k"], out) == [6] and out[0] == b"secret"
        with pytest.raises(ThreeFSError) as info:
            reader.batch_put([b"k2"], [b"x"])
        assert info.value.code == StatusCode.PERMISSION_DENIED
        forged = dict(cache=reader.cache_id, cap="0" * 64, keys=[b"k2"], lengths=[1])
        with pytest.raises(ThreeFSError) as info:  # the service checks the capability, not the client
            reader._meta.call("reserve", forged)
        assert info.value.code == StatusCode.PERMISSION_DENIED
        alice.chmod(root, 0o700)
        for name in (".cap-read", ".cap-write"):
            alice.chmod(f"{root}/{name}", 0o400)
        with pytest.raises(ThreeFSError) as info:
            KVCache(bob, root, page_bytes=PAGE, capacity_bytes=8 * PAGE)
        assert info.value.code == StatusCode.PERMISSION_DENIED
    finally:
        alice.close()
        bob.close()


def test_a_page_overwritten_under_its_entry_reads_as_a_miss(fs, d, rng):
    """What a writer stalled past its lease could do: bytes of another writer land in a published slot. The
    reader's crc32c check turns that into a miss and drops the entry; it never returns wrong bytes."""
    cache = KVCache(fs, f"{d}/c", page_bytes=PAGE, capacity_bytes=64 * PAGE)
    keys, data = [b"p%d" % i for i in range(40)], pages(rng, 40)
    assert cache.batch_put(keys, data) == [True] * 40
    (slot, length, _, _), = cache._call("lookup", keys=[keys[7]], touch=False, count="none")
    attr, offset = cache._where(slot)
    fs.batch_write([(attr, offset, rng.randbytes(length))])
    out = [bytearray(PAGE) for _ in keys]
    got = cache.batch_get_into(keys, out)  # 40 pages: read in parts from threads, each part checked
    assert got[7] == -1 and all(g == PAGE for i, g in enumerate(got) if i != 7)
    assert all(bytes(out[i]) == data[i] for i in range(40) if i != 7)
    s = cache.stats()
    assert s["corrupt"] == 1 and s["client"]["crc_mismatches"] == 1 and cache.batch_exists([keys[7]]) == 0


def test_a_damaged_registration_is_restored_by_the_service(private_cluster):
    """kvcache-1 owns /.kvcache/service.json: emptied (as one full test run once found it), the service
    notices within its check interval, logs what it found and publishes again; clients wait for that."""
    from threefs.client.client import Client
    from threefs.kvcache.service import SERVICE_FILE

    cluster = private_cluster(storage=3, replicas=3)
    fs = Client.connect(str(cluster.client_config_path))
    try:
        fs.write_bytes(SERVICE_FILE, b"")
        cache = KVCache(fs, "/c", page_bytes=PAGE, capacity_bytes=8 * PAGE)  # waits for the repair
        assert cache.batch_put([b"k"], [bytes(PAGE)]) == [True]
        assert b"does not name this service" in (cluster.dir / "log" / "kvcache-1.log").read_bytes()
    finally:
        fs.close()
