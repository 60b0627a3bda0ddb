"""The meta part without a cluster: CacheIndex (reserve/commit, LRU eviction in batches, TTL, leases) and its
SQLite store (what a restart of the service reloads)."""

from __future__ import annotations

from threefs.kvcache.index import EXISTS, NO_SPACE, RESERVED, CacheIndex
from threefs.kvcache.service import IndexStore, KVCacheService


def put(idx: CacheIndex, keys: list[bytes], now: float = 0.0) -> list[bool]:
    res = idx.reserve(keys, [10] * len(keys), now, lease_s=30)
    items = [(k, slot, gen, 10, 123) for k, (o, slot, gen) in zip(keys, res) if o == RESERVED]
    done = dict(zip([i[0] for i in items], idx.commit(items, now)))
    return [o == EXISTS or done.get(k, False) for k, (o, _, _) in zip(keys, res)]


def test_reserve_commit_visibility_and_duplicates():
    idx = CacheIndex(1, "/c", page_bytes=16, slots=4)
    res = idx.reserve([b"a", b"b", b"a"], [16, 16, 16], 0.0, 30)
    assert [r[0] for r in res] == [RESERVED, RESERVED, EXISTS]  # the same key twice: the first one writes
    assert idx.lookup([b"a"], 0.0) == [None]  # reserved is not visible
    assert idx.commit([(b"a", res[0][1], res[0][2], 16, 7)], 1.0) == [True]
    assert idx.lookup([b"a"], 1.0)[0].crc == 7
    assert idx.commit([(b"a", res[0][1], res[0][2], 16, 7)], 1.0) == [True]  # a retried commit
    assert idx.commit([(b"b", res[1][1], res[1][2] + 1, 16, 7)], 1.0) == [False]  # another generation
    # two writers of one key: each got its own slot; the first commit wins, the second slot is freed
    r1 = idx.reserve([b"k"], [16], 2.0, 30)[0]
    r2 = idx.reserve([b"k"], [16], 2.0, 30)[0]
    assert r1[1] != r2[1]
    assert idx.commit([(b"k", r1[1], r1[2], 16, 1)], 3.0) == [True]
    assert idx.commit([(b"k", r2[1], r2[2], 16, 2)], 3.0) == [False]
    assert idx.lookup([b"k"], 3.0)[0].crc == 1


def test_lru_eviction_in_batches_and_no_space_when_all_reserved():
    idx = CacheIndex(1, "/c", page_bytes=16, slots=10, evict_batch=3)
    assert put(idx, [b"%d" % i for i in range(10)]) == [True] * 10
    idx.lookup([b"0"], 1.0)  # 0 is now the most recent
    assert put(idx, [b"new"], 2.0) == [True]
    assert idx.counters.evictions == 3  # a batch of 3: 1, 2, 3 (not 0)
    assert [idx.lookup([b"%d" % i], 3.0, touch=False)[0] is None for i in range(5)] == [False, True, True, True, False]
    full = CacheIndex(2, "/d", page_bytes=16, slots=2)
    res = full.reserve([b"x", b"y", b"z"], [1, 1, 1], 0.0, 30)
    assert [r[0] for r in res] == [RESERVED, RESERVED, NO_SPACE]


def test_expired_reservations_and_ttl_free_their_slots():
    idx = CacheIndex(1, "/c", page_bytes=16, slots=2, ttl_s=100)
    res = idx.reserve([b"dead"], [16], 0.0, lease_s=30)  # the writer dies: never committed
    assert idx.sweep(10.0) == (0, 0)
    assert idx.sweep(31.0) == (1, 0) and not idx.reserved
    assert idx.commit([(b"dead", res[0][1], res[0][2], 16, 0)], 32.0) == [False]  # too late
    assert put(idx, [b"a", b"b"], 40.0) == [True, True]
    idx.lookup([b"b"], 100.0)
    assert idx.sweep(145.0) == (0, 1)  # a idle for 105 s > ttl; b was read at 100
    assert idx.lookup([b"a", b"b"], 146.0, touch=False)[0] is None and idx.counters.expirations == 1


def test_store_reloads_entries_reservations_and_lru_order(tmp_path):
    db = str(tmp_path / "index.db")
    svc = KVCacheService(IndexStore(db), clock=lambda: 10.0)  # before the lease of 30 s ends
    svc.by_id[1] = svc.by_root["/c"] = idx = CacheIndex(svc.store.create("/c", 16, 8, 0.0), "/c", 16, 8)
    assert put(idx, [b"a", b"b", b"c"], 1.0) == [True] * 3
    svc.store.persist(idx)
    idx.lookup([b"a"], 5.0)  # access times go out with the periodic flush
    pending = idx.reserve([b"p"], [16], 6.0, 30)[0]
    svc.tick()
    svc.store.close()
    again = KVCacheService(IndexStore(db)).by_root["/c"]  # as after kill -9 and a restart
    assert list(again.entries) == [b"b", b"c", b"a"]  # LRU order kept
    assert again.reserved[pending[1]].key == b"p"  # the slot stays taken until its lease ends
    assert again.next_gen > pending[2] and again.used_bytes == 30
    assert again.commit([(b"p", pending[1], pending[2], 16, 9)], 7.0) == [True]
    slots = {e.slot for e in again.entries.values()}
    assert len(slots) == 4 and again.hwm == 4


def test_store_keeps_the_order_of_a_delete_and_a_later_put_of_one_key(tmp_path):
    db = str(tmp_path / "index.db")
    store = IndexStore(db)
    idx = CacheIndex(store.create("/c", 16, 2, 0.0), "/c", 16, 2, evict_batch=1)
    assert put(idx, [b"a", b"b"]) == [True, True]
    idx.remove([b"a"])
    assert put(idx, [b"a"], 1.0) == [True]  # one journal: del a, res, unres, put a
    assert put(idx, [b"c"], 2.0) == [True]  # evicts b (least recently used)
    store.persist(idx)
    store.close()
    again = IndexStore(db).load()[0]
    assert list(again.entries) == [b"a", b"c"] and again.used_bytes == 20
    assert sorted(e.slot for e in again.entries.values()) == [0, 1] and list(again.free) == []
