"""threefs.queue on a real cluster: order and offsets, several producer processes on one partition, torn
tails, corruption, retention, replay, blocking polls, consumer groups, bad input, the CLI."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.queue import Admin, Consumer, Producer, TopicPartition

HELPER = str(Path(__file__).with_name("queue_proc.py"))
DEADLINE_S = 60.0


def _read_all(fs, root, topic, partitions, expect):
    """Every record of the topic, by partition, in the order a consumer returns them."""
    c = Consumer(fs, root=root)
    c.assign([TopicPartition(topic, p) for p in range(partitions)])
    got = defaultdict(list)
    deadline = time.monotonic() + DEADLINE_S
    while sum(len(v) for v in got.values()) < expect:
        assert time.monotonic() < deadline, f"read {sum(len(v) for v in got.values())} of {expect}"
        for tp, records in c.poll(timeout_ms=500).items():
            got[tp.partition].extend(records)
    c.close()
    return got


def test_offsets_are_dense_and_records_come_back_in_order(fs, d, rng):
    Admin(fs, d).create_topic("t", 3)
    sent = []
    with Producer(fs, root=d, batch_bytes=8192, linger_ms=1) as p:
        for i in range(3000):
            key = f"k{rng.randrange(10)}".encode()
            value = rng.randbytes(rng.randrange(0, 300))
            sent.append((key, value, p.send("t", value, key=key, headers=[("i", str(i).encode())] if i % 7 == 0
                                            else None)))
        p.flush()
    by_part = defaultdict(list)
    for key, value, f in sent:
        m = f.get(timeout=1)
        by_part[m.partition].append((m.offset, key, value))
    for part, items in by_part.items():
        assert [o for o, _, _ in items] == list(range(len(items)))  # dense, in send order
    got = _read_all(fs, d, "t", 3, len(sent))
    for part, records in got.items():
        assert [(r.offset, r.key, r.value) for r in records] == by_part[part]
    headers = [r.headers for rs in got.values() for r in rs if r.headers]
    assert len(headers) == len(range(0, 3000, 7))


def test_two_producer_processes_share_one_partition_without_loss(fs, d, cluster):
    """Small batches so the two processes keep racing for the next index entry."""
    Admin(fs, d).create_topic("shared", 1)
    conf = str(cluster.client_config_path)
    procs = [subprocess.Popen([sys.executable, HELPER, "produce", conf, d, "shared", name, "1500", "2048", "0"],
                              stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    acks = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=DEADLINE_S * 2)
        assert proc.returncode == 0 and out.strip().endswith("DONE")
        for line in out.splitlines():
            if line.startswith("ACK "):
                _, part, offset, value = line.split()
                acks[int(offset)] = value
    assert sorted(acks) == list(range(3000))  # one order, no offset given twice, none lost
    records = _read_all(fs, d, "shared", 1, 3000)[0]
    assert [(r.offset, r.value.decode()) for r in records] == sorted(acks.items())
    for name in ("a", "b"):  # each producer's records keep its send order
        mine = [int(r.value.decode().split("-")[1]) for r in records if r.value.decode().startswith(name)]
        assert mine == list(range(1500))
    segments = fs.listdir(f"{d}/shared/p0000/segments")
    assert len(segments) == 2  # one per producer: nobody else writes a producer's file


def test_torn_tail_is_cut_when_the_producer_restarts(fs, d):
    Admin(fs, d).create_topic("torn", 1)
    with Producer(fs, root=d, producer_id="p1", batch_bytes=4096) as p:
        for i in range(200):
            p.send("torn", b"r%03d" % i)
    seg = f"{d}/torn/p0000/segments/p1.000001"
    good = fs.stat(seg).length
    whole = fs.read_bytes(seg)
    with fs.open(seg, "r+b", buffering=0) as f:  # a crash mid-write: half of a batch at the end
        f.seek(good)
        f.write(whole[: len(whole) // 2 + 17])
    assert fs.stat(seg).length > good
    with Producer(fs, root=d, producer_id="p1", batch_bytes=4096) as p:
        p.send("torn", b"after").get(timeout=DEADLINE_S)
        assert p._writers[("torn", 0)].torn_bytes_cut == len(whole) // 2 + 17
    assert fs.stat(seg).length == good  # cut back to the last whole batch
    assert fs.listdir(f"{d}/torn/p0000/segments") == ["p1.000001", "p1.000002"]
    records = _read_all(fs, d, "torn", 1, 201)[0]
    assert [r.value for r in records] == [b"r%03d" % i for i in range(200)] + [b"after"]


def test_a_producer_id_has_one_live_producer(fs, d):
    Admin(fs, d).create_topic("ids", 1)
    with Producer(fs, root=d, producer_id="solo") as p:
        p.send("ids", b"1").get(timeout=DEADLINE_S)
        with pytest.raises(FileExistsError, match="is in use"):
            Producer(fs, root=d, producer_id="solo")  # it would cut the live one's batches in flight
        p.send("ids", b"2").get(timeout=DEADLINE_S)
    lease = f"{d}/.producers/dead"  # a holder that died: its lease is old
    fs.symlink("token-of-a-dead-producer", lease)
    fs.run(fs.aio.setattr(lease, follow=False, mtime_ns=time.time_ns() - 3600 * 10**9))
    with Producer(fs, root=d, producer_id="dead") as p:  # takes the stale lease over
        p.send("ids", b"3").get(timeout=DEADLINE_S)
    assert [r.value for r in _read_all(fs, d, "ids", 1, 3)[0]] == [b"1", b"2", b"3"]
    assert fs.listdir(f"{d}/.producers") == [".clock"]  # both released their leases


def test_a_corrupt_batch_is_an_error_not_bad_records(fs, d):
    Admin(fs, d).create_topic("bad", 1)
    with Producer(fs, root=d) as p:
        p.send("bad", b"A" * 1000).get(timeout=DEADLINE_S)
    seg = f"{d}/bad/p0000/segments/" + fs.listdir(f"{d}/bad/p0000/segments")[0]
    with fs.open(seg, "r+b", buffering=0) as f:
        f.seek(500)
        f.write(b"B")  # one flipped byte in the record
    c = Consumer(fs, root=d)
    c.assign([TopicPartition("bad", 0)])
    with pytest.raises(ThreeFSError) as e:
        c.poll(timeout_ms=2000)
    assert e.value.code == StatusCode.CHECKSUM_MISMATCH and "CRC" in e.value.message


def test_retention_by_size_keeps_the_newest_and_removes_segments(fs, d):
    Admin(fs, d).create_topic("size", 1, retention_bytes=20_000, segment_bytes=64 << 10)
    with Producer(fs, root=d, batch_bytes=4096, linger_ms=0) as p:
        for i in range(100):
            p.send("size", bytes([i]) * 1000)
    admin = Admin(fs, d)
    before = admin.describe_topic("size")[0]
    assert before.bytes > 90_000 and before.segments >= 2
    removed = admin.enforce_retention("size")
    after = admin.describe_topic("size")[0]
    assert after.bytes <= 20_000 and after.end_offset == 100 and after.first_offset > 0
    assert removed["batches"] > 0 and removed["segments"] >= 1 and after.segments < before.segments
    c = Consumer(fs, root=d)
    c.assign([TopicPartition("size", 0)])
    records = []
    while len(records) < 100 - after.first_offset:
        records += c.poll(timeout_ms=2000).get(TopicPartition("size", 0), [])
    assert records[0].offset == after.first_offset and records[-1].offset == 99
    assert all(r.value == bytes([r.offset]) * 1000 for r in records)


def test_producers_apply_retention_as_they_write(fs, d):
    Admin(fs, d).create_topic("auto", 1, retention_bytes=10_000)
    with Producer(fs, root=d, batch_bytes=2048, linger_ms=0, retention_check_s=0) as p:
        for i in range(60):
            p.send("auto", b"%04d" % i * 100).get(timeout=DEADLINE_S)
    info = Admin(fs, d).describe_topic("auto")[0]
    assert info.end_offset == 60 and info.first_offset > 0 and info.bytes <= 10_000 + 2048


def test_retention_by_age_and_a_consumer_behind_it_moves_on(fs, d):
    Admin(fs, d).create_topic("age", 1, retention_ms=3600_000)
    old = int(time.time() * 1000) - 7200_000
    c = Consumer(fs, root=d)
    c.assign([TopicPartition("age", 0)])
    with Producer(fs, root=d, batch_bytes=2048) as p:
        for i in range(20):
            p.send("age", b"old%d" % i, timestamp_ms=old + i)
        p.flush()
        assert c.poll(timeout_ms=2000)  # the consumer is somewhere in the old records
        for i in range(5):
            p.send("age", b"new%d" % i)
    Admin(fs, d).enforce_retention("age")
    info = Admin(fs, d).describe_topic("age")[0]
    assert info.first_offset >= 20 - 2 and info.end_offset == 25  # old batches gone (the one new stays)
    values = []
    deadline = time.monotonic() + DEADLINE_S
    while b"new4" not in values:
        assert time.monotonic() < deadline
        values += [r.value for r in c.poll(timeout_ms=500).get(TopicPartition("age", 0), [])]
    assert values[-5:] == [b"new%d" % i for i in range(5)]


def test_replay_from_any_offset_and_committed_positions(fs, d):
    Admin(fs, d).create_topic("replay", 1)
    with Producer(fs, root=d, batch_bytes=1024) as p:
        for i in range(500):
            p.send("replay", b"%d" % i)
    tp = TopicPartition("replay", 0)
    c = Consumer(fs, "replay", group_id="g1", root=d, enable_auto_commit=False)
    for offset in (0, 1, 137, 250, 499):  # batch starts and middles
        c.seek(tp, offset)
        assert c.position(tp) == offset
        first = c.poll(timeout_ms=2000)[tp][0]
        assert (first.offset, first.value) == (offset, b"%d" % offset)
    c.seek(tp, 10_000)  # past the end: the end
    assert c.position(tp) == 500 and c.poll(timeout_ms=100) == {}
    c.seek(tp, 300)
    c.poll(timeout_ms=2000, max_records=7)
    c.commit()
    assert c.committed(tp) == 307
    c.close(commit=False)
    c2 = Consumer(fs, "replay", group_id="g1", root=d)
    assert c2.position(tp) == 307 and c2.poll(timeout_ms=2000)[tp][0].offset == 307
    c2.seek_to_beginning()
    assert c2.poll(timeout_ms=2000)[tp][0].offset == 0
    c2.seek_to_end()
    assert c2.position(tp) == 500
    c2.close()


def test_poll_waits_for_records_and_returns_empty_at_its_timeout(fs, d):
    Admin(fs, d).create_topic("wait", 1)
    c = Consumer(fs, root=d)
    tp = TopicPartition("wait", 0)
    c.assign([tp])
    assert c.poll(timeout_ms=200) == {}
    assert c.poll(timeout_ms=0) == {}

    def later():
        time.sleep(0.3)
        with Producer(fs, root=d) as p:
            p.send("wait", b"late")
    th = threading.Thread(target=later)
    th.start()
    got = c.poll(timeout_ms=DEADLINE_S * 1000)
    th.join()
    assert [r.value for r in got[tp]] == [b"late"]


def test_a_group_spreads_partitions_and_takes_over_from_a_member_that_leaves(fs, d):
    Admin(fs, d).create_topic("grp", 4)
    with Producer(fs, root=d) as p:
        for i in range(400):
            p.send("grp", b"%d" % i, partition=i % 4)
    kw = dict(group_id="g", root=d, session_timeout_s=2.0, heartbeat_interval_s=0.2)

    class Listener:
        owned: set = set()

        def on_partitions_revoked(self, revoked):
            self.owned = self.owned - revoked

        def on_partitions_assigned(self, assigned):
            self.owned = self.owned | assigned
    heard = Listener()
    a, b = Consumer(fs, "grp", member_id="a", **kw), Consumer(fs, "grp", member_id="b", listener=heard, **kw)
    deadline = time.monotonic() + DEADLINE_S
    while not (len(a.assignment()) == 2 and len(b.assignment()) == 2):
        assert time.monotonic() < deadline, (a.assignment(), b.assignment())
        time.sleep(0.1)
    assert a.assignment() | b.assignment() == {TopicPartition("grp", p) for p in range(4)}
    seen = set()
    for _ in range(3):
        for c in (a, b):
            for tp, rs in c.poll(timeout_ms=200).items():
                seen.update((tp.partition, r.offset) for r in rs)
    a.close()  # commits and leaves: b takes every partition, starting at a's committed offsets
    while len(b.assignment()) != 4:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert heard.owned == b.assignment()  # the listener heard every change
    while len(seen) < 400:
        assert time.monotonic() < deadline, len(seen)
        for tp, rs in b.poll(timeout_ms=200).items():
            seen.update((tp.partition, r.offset) for r in rs)
    assert seen == {(p, o) for p in range(4) for o in range(100)}
    b.close()
    assert set(Admin(fs, d).describe_group("g").committed.values()) == {100}


def test_a_member_that_stops_heartbeating_is_expired(fs, d):
    Admin(fs, d).create_topic("exp", 2)
    kw = dict(group_id="g", root=d, session_timeout_s=1.0, heartbeat_interval_s=0.2)
    a, b = Consumer(fs, "exp", member_id="a", **kw), Consumer(fs, "exp", member_id="b", **kw)
    a._hb_stop.set()  # a hangs (no heartbeats, no leave), as a killed process would
    a._hb_thread.join(timeout=DEADLINE_S)
    deadline = time.monotonic() + DEADLINE_S
    while len(b.assignment()) != 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert list(Admin(fs, d).describe_group("g").members) == ["b"]
    b.close()


def test_bad_input_gets_clear_errors(fs, d):
    admin = Admin(fs, d)
    for bad in ("", "a/b", "..", "x" * 201, "sp ace"):
        with pytest.raises(ThreeFSError) as e:
            admin.create_topic(bad, 1)
        assert e.value.code == StatusCode.INVALID_ARGUMENT and "topic name" in e.value.message
    with pytest.raises(ThreeFSError, match="partitions must be"):
        admin.create_topic("zero", 0)
    with pytest.raises(ThreeFSError, match="retention_ms"):
        admin.create_topic("ret", 1, retention_ms=-5)
    admin.create_topic("ok", 2)
    with pytest.raises(FileExistsError, match="exists"):
        admin.create_topic("ok", 2)
    with Producer(fs, root=d) as p:
        with pytest.raises(FileNotFoundError, match="does not exist.*threefs queue create"):
            p.send("nope", b"x")
        with pytest.raises(ThreeFSError, match="must be bytes"):
            p.send("ok", "a string")
        with pytest.raises(ThreeFSError, match="key must be bytes"):
            p.send("ok", b"x", key=7)
        with pytest.raises(ThreeFSError, match="partitions 0..1"):
            p.send("ok", b"x", partition=2)
        with pytest.raises(ThreeFSError, match="headers"):
            p.send("ok", b"x", headers=[("a", "b")])
    with pytest.raises(ThreeFSError, match="closed"):
        p.send("ok", b"x")
    with pytest.raises(ThreeFSError, match="producer_id"):
        Producer(fs, root=d, producer_id="bad/id")
    c = Consumer(fs, root=d)
    with pytest.raises(ThreeFSError, match="partitions 0..1"):
        c.assign([TopicPartition("ok", 5)])
    c.assign([TopicPartition("ok", 0)])
    with pytest.raises(ThreeFSError, match="offset must be"):
        c.seek(TopicPartition("ok", 0), -1)
    with pytest.raises(ThreeFSError, match="not assigned"):
        c.seek(TopicPartition("ok", 1), 0)
    with pytest.raises(ThreeFSError, match="group_id"):
        c.commit()
    with pytest.raises(ThreeFSError, match="auto_offset_reset"):
        Consumer(fs, root=d, auto_offset_reset="middle")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Consumer(fs, "missing", group_id="g", root=d)


def test_cli_ls_describe_tail(fs, d, cluster):
    conf = str(cluster.client_config_path)

    def cli(*args, stdin=None):
        r = subprocess.run([sys.executable, "-m", "threefs.cli.main", "--config", conf, "queue", "--root", d,
                            *args], capture_output=True, text=True, input=stdin, timeout=DEADLINE_S)
        return r.returncode, r.stdout, r.stderr

    assert cli("create", "logs", "--partitions", "2")[0] == 0
    rc, _, err = cli("produce", "logs", "--key", "k", stdin="".join(f"line {i}\n" for i in range(30)))
    assert rc == 0 and "30 record(s) stored" in err
    rc, out, _ = cli("ls")
    assert rc == 0 and "logs" in out and "30 records" in out
    rc, out, _ = cli("describe", "logs")
    assert rc == 0 and "2 partition(s)" in out
    rc, out, _ = cli("tail", "logs", "-n", "3")
    assert rc == 0 and out.splitlines()[-1].endswith("k line 29") and len(out.splitlines()) == 3
    c = Consumer(fs, "logs", group_id="cg", root=d)
    while sum(len(v) for v in c.poll(timeout_ms=1000).values()):
        pass
    c.close()
    rc, out, _ = cli("describe", "--group", "cg")
    assert rc == 0 and "lag 0" in out
    rc, _, err = cli("describe", "missing")
    assert rc == 1 and "does not exist" in err
    rc, _, err = cli("create", "bad/name")
    assert rc == 2 and "INVALID_ARGUMENT" in err
