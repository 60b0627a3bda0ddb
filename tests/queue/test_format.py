"""The queue's pure parts, without a cluster: the batch format, torn-tail detection, index entries, and
the group assignment."""

from __future__ import annotations

import random

import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.queue import format as fmt
from threefs.queue.group import assign


def _batch(rng: random.Random, n: int) -> tuple[bytearray, list]:
    b = fmt.BatchBuilder()
    sent = []
    for i in range(n):
        key = None if i % 3 == 0 else rng.randbytes(rng.randrange(0, 20))
        value = rng.randbytes(rng.randrange(0, 500))
        headers = [("h", b"%d" % i)] if i % 5 == 0 else None
        b.append(value, key, 1_000 + i, headers)
        sent.append((key, value, 1_000 + i, headers or []))
    return b.seal(0), sent


def test_a_batch_decodes_to_what_was_appended(rng):
    data, sent = _batch(rng, 200)
    entry = fmt.IndexEntry("p.000001", 0, len(data), 200, 5_000, 1_199)
    records = fmt.decode_batch(memoryview(bytes(data)), entry, "here", "t", 3)
    assert [(r.key, r.value, r.timestamp_ms, r.headers) for r in records] == sent
    assert [r.offset for r in records] == list(range(5_000, 5_200))
    assert {(r.topic, r.partition) for r in records} == {("t", 3)}
    assert fmt.verify_records(memoryview(bytes(data))) == []


def test_torn_and_flipped_batches_are_found(rng):
    first, _ = _batch(rng, 50)
    second, _ = _batch(rng, 50)
    segment = bytes(first + second)
    assert fmt.batch_span(memoryview(segment)) == len(first)
    assert fmt.batch_span(memoryview(segment)[len(first):]) == len(second)
    for cut in (1, 31, 32, len(second) // 2, len(second) - 1):  # every torn tail is invalid
        assert fmt.batch_span(memoryview(segment)[len(first):len(first) + cut]) == 0
    flipped = bytearray(segment)
    flipped[len(first) + 200] ^= 0x10
    assert fmt.batch_span(memoryview(bytes(flipped))[len(first):]) == 0
    bad = fmt.verify_records(memoryview(bytes(flipped))[len(first):])
    assert len(bad) == 1  # the record holding the flipped byte, and only it
    entry = fmt.IndexEntry("p.000001", len(first), len(second), 50, 0, 0)
    with pytest.raises(ThreeFSError) as e:
        fmt.decode_batch(memoryview(bytes(flipped))[len(first):], entry, "p0 seq 1")
    assert e.value.code == StatusCode.CHECKSUM_MISMATCH and "p0 seq 1" in e.value.message
    wrong_count = entry._replace(count=49)
    with pytest.raises(ThreeFSError, match="49"):
        fmt.decode_batch(memoryview(segment)[len(first):], wrong_count, "x")


def test_index_entries_round_trip_and_reject_garbage():
    e = fmt.IndexEntry("abc.000007", 123, 456, 7, 1_000_000, 1_796_000_000_000)
    assert fmt.IndexEntry.decode(e.encode()) == e and e.end_offset == 1_000_007
    for bad in ("", "q2:a:1:2:3:4:5", "q1:a:1:2:3", "q1:a:x:2:3:4:5"):
        with pytest.raises((ThreeFSError, ValueError)):
            fmt.IndexEntry.decode(bad)


def test_bad_records_are_refused_before_buffering():
    with pytest.raises(ThreeFSError, match="must be bytes"):
        fmt.check_record_input("str", None, None)
    with pytest.raises(ThreeFSError, match="exceeds"):
        fmt.check_record_input(b"x" * (fmt.RECORD_BYTES_MAX + 1), None, None)
    with pytest.raises(ThreeFSError, match="headers"):
        fmt.check_record_input(b"x", None, [("k", "not bytes")])
    assert fmt.check_record_input(bytearray(b"v"), memoryview(b"k"), [("a", b"b")]) == (b"v", b"k")


@pytest.mark.parametrize("seed", range(20))
def test_assignment_gives_every_partition_one_member_evenly(seed):
    rng = random.Random(seed)
    topics = {f"t{i}": rng.randrange(1, 12) for i in range(rng.randrange(1, 4))}
    members = {f"m{i:02d}": tuple(t for t in topics if rng.random() < 0.8) or (next(iter(topics)),)
               for i in range(rng.randrange(1, 7))}
    got = assign(topics, members)
    assert got == assign(topics, dict(reversed(list(members.items()))))  # the order of the view does not matter
    for topic, n in topics.items():
        owners = [m for m, tps in got.items() for t, _ in tps if t == topic]
        subs = [m for m, ts in members.items() if topic in ts]
        assert sorted(p for m in got for t, p in got[m] if t == topic) == (list(range(n)) if subs else [])
        assert set(owners) <= set(subs)
        if subs:
            counts = [sum(1 for t, _ in got[m] if t == topic) for m in subs]
            assert max(counts) - min(counts) <= 1
