"""threefs.kvstore on a real cluster: semantics, CAS races between processes, large values, prefix scans,
atomic batches, permissions, bad input."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.kvstore import KVStore

HELPER = str(Path(__file__).with_name("kv_proc.py"))
DEADLINE_S = 120.0
INLINE = 64 << 10


def test_get_put_delete_and_versions(fs, d):
    kv = KVStore.create(fs, f"{d}/s")
    assert kv.get(b"a") is None and kv.get(b"a", b"dflt") == b"dflt" and b"a" not in kv
    v1 = kv.put(b"a", b"1")
    v2 = kv.put("a", bytearray(b"2"))  # str keys are UTF-8; any bytes-like value
    assert v2 > v1 > 0 and kv[b"a"] == b"2" and b"a" in kv
    item = kv.get_item(b"a")
    assert (item.value, item.version, item.length) == (b"2", v2, 1)
    assert kv.delete(b"a") and not kv.delete(b"a")
    with pytest.raises(KeyError):
        kv[b"a"]
    with pytest.raises(KeyError):
        del kv[b"a"]
    v3 = kv.put(b"a", b"3")
    assert v3 > v2  # versions only grow, also across delete and re-create
    kv.put(b"empty", b"")
    assert kv.get(b"empty") == b"" and kv.get_many([b"a", b"nope", b"empty"]) == [b"3", None, b""]
    assert KVStore(fs, f"{d}/s").get(b"a") == b"3"  # another handle, same data


def test_compare_and_set_by_value_and_version(fs, d):
    kv = KVStore.create(fs, f"{d}/s")
    assert kv.compare_and_set(b"k", None, b"x")  # absent -> x
    assert not kv.compare_and_set(b"k", None, b"y")
    assert not kv.compare_and_set(b"k", b"wrong", b"y") and kv.get(b"k") == b"x"
    assert kv.compare_and_set(b"k", b"x", b"y") and kv.get(b"k") == b"y"
    v = kv.get_item(b"k").version
    assert not kv.compare_and_set_version(b"k", v - 1, b"z")
    assert kv.compare_and_set_version(b"k", v, b"z") and kv.get(b"k") == b"z"
    assert not kv.compare_and_set_version(b"k", 0, b"again")  # 0: must be absent
    assert kv.compare_and_set(b"k", b"z", None) and kv.get(b"k") is None  # CAS delete
    assert kv.compare_and_set_version(b"k", 0, b"new") and kv.get(b"k") == b"new"


def test_cas_races_between_processes(fs, d, cluster, tmp_path):
    """Four processes increment one counter and append to one log by CAS: no update is lost, and exactly
    one of them becomes leader."""
    store = f"{d}/race"
    KVStore.create(fs, store)
    go = tmp_path / "go"
    names, rounds = ["p0", "p1", "p2", "p3"], 25
    procs = [subprocess.Popen([sys.executable, HELPER, str(cluster.client_config_path), store, n, str(rounds),
                               str(go)], stdout=subprocess.PIPE, text=True) for n in names]
    go.write_text("go")
    outs = [p.communicate(timeout=DEADLINE_S)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    kv = KVStore(fs, store)
    assert kv.get(b"counter") == b"%d" % (len(names) * rounds)
    log = kv.get(b"log").decode().rstrip(",").split(",")
    assert sorted(log) == sorted(names * rounds)
    assert sum("LEADER yes" in o for o in outs) == 1
    assert kv.get(b"leader").decode() in names
    retries = sum(int(o.split("RETRIES ")[1].split()[0]) for o in outs)
    print(f"{len(names) * rounds * 2} CAS updates by {len(names)} processes; {retries} CAS retries")


@pytest.mark.parametrize("size", [0, 1, INLINE, INLINE + 1, 20 << 20])
def test_values_of_every_size(fs, d, rng, size):
    kv = KVStore.create(fs, f"{d}/s")
    value = rng.randbytes(size)
    kv.put(b"v", value)
    assert kv.get(b"v") == value and kv.get_item(b"v").length == size
    blobs = fs.listdir(f"{d}/s/.blobs")
    assert len(blobs) == (1 if size > INLINE else 0)  # large values live in a file
    other = rng.randbytes(size) if size else b"z"
    assert kv.compare_and_set(b"v", value, other) and not kv.compare_and_set(b"v", value, b"x")
    assert kv.get(b"v") == other
    assert len(fs.listdir(f"{d}/s/.blobs")) == len(blobs)  # the replaced blob was removed
    kv.delete(b"v")
    assert fs.listdir(f"{d}/s/.blobs") == []


def test_a_large_value_streams_from_a_file_object(fs, d, rng, tmp_path):
    kv = KVStore.create(fs, f"{d}/s")
    data = rng.randbytes(24 << 20)
    local = tmp_path / "big.bin"
    local.write_bytes(data)
    with open(local, "rb") as f:
        kv.put(b"file", f)
    assert kv.get(b"file") == data
    out = tmp_path / "out.bin"
    with open(out, "wb") as f:  # and back into a file, without holding it in memory
        assert kv.get_to(b"file", f) == len(data)
    assert out.read_bytes() == data
    buf = io.BytesIO()
    assert kv.get_to(b"nothing", buf) is None
    kv.put(b"small", io.BytesIO(b"tiny"))
    assert kv.get_to(b"small", buf) == 4 and buf.getvalue() == b"tiny"
    assert kv.get(b"small") == b"tiny" and len(fs.listdir(f"{d}/s/.blobs")) == 1
    for key, value in kv.scan():  # scans return large values too
        assert value == (data if key == b"file" else b"tiny")


def test_prefix_scans_in_byte_order(fs, d, rng):
    kv = KVStore.create(fs, f"{d}/s")
    other = KVStore.create(fs, f"{d}/other")
    other.put(b"a1", b"not mine")
    keys = {b"a", b"a\x00", b"a\xff", b"a\xff\xff", b"ab", b"b", b"\xff", b"\x00", b"user:1", b"user:10",
            b"user:2", b"user;", b"use"} | {b"p:%04d" % i for i in range(2500)}
    shuffled = sorted(keys, key=lambda _: rng.random())
    for k in shuffled[:20]:
        kv.put(k, k[::-1])
    for i in range(20, len(shuffled), 1000):
        kv.put_many([(k, k[::-1]) for k in shuffled[i:i + 1000]])
    assert list(kv.keys()) == sorted(keys)
    assert list(kv.keys(b"a")) == [b"a", b"a\x00", b"ab", b"a\xff", b"a\xff\xff"]  # bytewise
    assert list(kv.keys(b"a\xff")) == [b"a\xff", b"a\xff\xff"]
    assert list(kv.keys(b"\xff")) == [b"\xff"]
    assert list(kv.scan(b"user:")) == [(k, k[::-1]) for k in (b"user:1", b"user:10", b"user:2")]
    assert list(kv.keys(b"user:", start_after=b"user:10")) == [b"user:2"]
    assert list(kv.keys(b"zz")) == []
    scanned = list(kv.scan(b"p:", page=333))  # several pages
    assert [k for k, _ in scanned] == sorted(k for k in keys if k.startswith(b"p:"))
    assert list(kv.keys(b"p:", limit=5)) == [b"p:%04d" % i for i in range(5)]
    assert list(kv.keys(b"p:", start_after=b"p:2497")) == [b"p:2498", b"p:2499"]
    assert list(other.keys()) == [b"a1"]


def test_batches_are_atomic(fs, d):
    kv = KVStore.create(fs, f"{d}/s")
    kv.put(b"x", b"1")
    vx = kv.get_item(b"x").version
    b = kv.batch().put(b"a", b"A").delete(b"x").put(b"big", b"B" * (INLINE * 2)).check_version(b"x", vx + 1)
    assert not b.commit()  # the check fails: nothing happened, and the blob written for it is gone
    assert kv.get(b"x") == b"1" and kv.get(b"a") is None and fs.listdir(f"{d}/s/.blobs") == []
    with kv.batch() as b:
        b.put(b"a", b"A").delete(b"x").put(b"big", b"B" * (INLINE * 2)).check_version(b"x", vx)
        b.check_value(b"nothing", None)
    assert kv.get(b"a") == b"A" and kv.get(b"x") is None and kv.get(b"big") == b"B" * (INLINE * 2)
    assert len(b.versions) == 3
    with pytest.raises(ThreeFSError, match="did not hold"):
        with kv.batch() as b:
            b.put(b"c", b"C").check_value(b"a", b"not A")
    assert kv.get(b"c") is None
    versions = kv.put_many({b"m%d" % i: b"%d" % i for i in range(1000)})
    assert len(set(versions)) == 1 and kv.get_many([b"m0", b"m999"]) == [b"0", b"999"]
    big = b"v" * 4000  # 250 replaced values of 4 KB (1 MB: past one frame, some go to blobs): the reply,
    kv.put_many({b"m%d" % i: big for i in range(250)})  # kept for retries, carries none of them
    assert kv.put_many({b"m%d" % i: big for i in range(250)})[0] > versions[0]
    assert kv.get_many([b"m%d" % i for i in range(250)]) == [big] * 250
    assert 0 < len(fs.listdir(f"{d}/s/.blobs")) < 250 - 150


def test_permissions_of_the_store_directory_apply(fs, d):
    from threefs.client.client import Client
    from threefs.common.config import ClientConfig, load_toml
    from threefs.rpc.schemas import mgmtd as ms

    kv = KVStore.create(fs, f"{d}/private", mode=0o700)
    kv.put(b"secret", b"s")
    pub = KVStore.create(fs, f"{d}/public", mode=0o755)
    pub.put(b"k", b"v")
    token = fs.run(fs.aio.mgmtd.call("user_add", ms.UserReq("kvtest-eve", 4242, 4242), ms.UserTokenRsp)).token
    base = load_toml(fs.config.cluster_dir + "/client.toml", ClientConfig) if fs.config.cluster_dir else fs.config
    with Client.connect(ClientConfig(mgmtd=base.mgmtd, token=token, cluster_dir=base.cluster_dir)) as eve:
        with pytest.raises(PermissionError, match="permission denied"):
            KVStore(eve, f"{d}/private").get(b"secret")
        with pytest.raises(PermissionError):
            KVStore(eve, f"{d}/private").put(b"x", b"y")
        assert KVStore(eve, f"{d}/public").get(b"k") == b"v"  # r on the directory: reads
        with pytest.raises(PermissionError, match="needs w"):
            KVStore(eve, f"{d}/public").put(b"k", b"mine")
        with pytest.raises(PermissionError):
            list(KVStore(eve, f"{d}/private").keys())
    assert pub.get(b"k") == b"v"


def test_bad_input_gets_clear_errors(fs, d):
    kv = KVStore.create(fs, f"{d}/s")
    for bad in (b"", b"k" * 4097, 7, None):
        with pytest.raises(ThreeFSError) as e:
            kv.put(bad, b"v")
        assert e.value.code == StatusCode.INVALID_ARGUMENT and "key" in e.value.message
    with pytest.raises(ThreeFSError, match="not str"):
        kv.put(b"k", "text")
    with pytest.raises(ThreeFSError, match="bytes-like"):
        kv.put(b"k", 12)
    with pytest.raises(ThreeFSError, match="version must be"):
        kv.compare_and_set_version(b"k", -1, b"v")
    with pytest.raises(ThreeFSError, match="at most 1000"):
        kv.get_many([b"k%d" % i for i in range(1001)])
    with pytest.raises(ThreeFSError, match="at most 1000"):
        kv.put_many([(b"k%d" % i, b"") for i in range(1001)])
    with pytest.raises(ThreeFSError, match="4096"):
        list(kv.keys(b"p" * 5000))
    with pytest.raises(ThreeFSError, match="each key at most once"):
        kv.batch().put(b"k", b"1").put(b"k", b"2").commit()
    with pytest.raises(ThreeFSError, match="must be absolute"):
        KVStore(fs, "relative/path")
    with pytest.raises(FileNotFoundError):
        KVStore(fs, f"{d}/missing").get(b"k")
    fs.write_bytes(f"{d}/afile", b"x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        KVStore(fs, f"{d}/afile").put(b"k", b"v")
    assert kv.get(b"k") is None  # nothing of the failed calls was written


def test_a_leftover_blob_is_collected(fs, d):
    kv = KVStore.create(fs, f"{d}/s")
    kv.put(b"keep", b"K" * (INLINE + 10))
    fs.write_bytes(f"{d}/s/.blobs/orphan", b"left by a client that died")  # a blob no record names
    assert kv.gc_blobs(min_age_s=3600) == 0  # too young: it may be a put in progress
    assert kv.gc_blobs(min_age_s=0) == 1
    assert len(fs.listdir(f"{d}/s/.blobs")) == 1 and kv.get(b"keep") == b"K" * (INLINE + 10)


def test_a_retried_write_is_applied_once_and_answers_the_same(fs, d):
    """A CAS whose reply was lost is retried with the same request id (the client library does that on
    failover): it must not be applied twice, nor be reported as failed because it saw its own write."""
    from threefs.rpc.schemas import kvstore as k
    from threefs.kvstore.store import digest_of

    kv = KVStore.create(fs, f"{d}/s")
    kv.put(b"n", b"1")
    op = k.KvOp(k.PUT, b"n", b"2", length=1, digest=digest_of(b"2"), expect_digest=digest_of(b"1"))
    req = k.KvWriteReq(f"{d}/s", [op], request_id=987654321)
    first = fs.run(fs.aio.meta_call("kv_write", req, k.KvWriteRsp))
    again = fs.run(fs.aio.meta_call("kv_write", k.KvWriteReq(f"{d}/s", [op], request_id=987654321),
                                     k.KvWriteRsp))
    assert first.ok and again.ok and again.versions == first.versions
    assert kv.get_item(b"n").version == first.versions[0] and kv.get(b"n") == b"2"
    fresh = fs.run(fs.aio.meta_call("kv_write", k.KvWriteReq(f"{d}/s", [op]), k.KvWriteRsp))
    assert not fresh.ok  # a new request with the same condition fails: the value is 2 now


def test_clear_and_drop(fs, d):
    kv = KVStore.create(fs, f"{d}/s")
    kv.put_many([(b"k%d" % i, b"v") for i in range(50)])
    kv.put(b"big", b"B" * (INLINE + 1))
    keep = KVStore.create(fs, f"{d}/keep")
    keep.put(b"k1", b"stays")
    kv.clear()
    assert list(kv.keys()) == [] and fs.listdir(f"{d}/s/.blobs") == []
    kv.put(b"again", b"1")
    kv.drop()
    assert not fs.exists(f"{d}/s") and keep.get(b"k1") == b"stays"
    again = KVStore.create(fs, f"{d}/s")  # a new directory: a new store, nothing of the old one
    assert list(again.keys()) == []


def test_many_inline_values_span_several_replies(fs, d, rng):
    """30 values of 60 KiB are 1.8 MB inline: more than one frame carries, so gets and scans come back in
    several replies, and a batch of them spills some to blobs."""
    kv = KVStore.create(fs, f"{d}/s")
    values = {b"v%02d" % i: rng.randbytes(60 << 10) for i in range(30)}
    for key, value in values.items():
        kv.put(key, value)
    assert fs.listdir(f"{d}/s/.blobs") == []  # each fits inline on its own
    assert kv.get_many(list(values)) == list(values.values())
    assert dict(kv.scan(b"v")) == values
    kv.clear()
    kv.put_many(values)  # together they do not fit one request: the batch spills some values to blobs
    assert 0 < len(fs.listdir(f"{d}/s/.blobs")) < 30
    assert kv.get_many(list(values)) == list(values.values())
