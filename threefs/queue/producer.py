"""Producer: Kafka's client shape over segment files and index symlinks (see log.py for the protocol).

    p = Producer(fs)                                    # fs = threefs.connect()
    fut = p.send("events", b"payload", key=b"user-7")   # buffered; returns a future at once
    meta = fut.get(timeout=10)                          # RecordMetadata(topic, partition, offset, ...)
    p.flush(); p.close()

Records are gathered per partition into batches (up to batch_bytes, or linger_ms after the first
record). A background sender writes the sealed batches of all partitions to storage in parallel and
publishes each with one index entry, in order per partition; the writes of the next batches overlap the
publication of the previous ones. A future resolves only after the batch's index entry exists, i.e. the
bytes are on every replica and the offsets are final.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
import uuid
import zlib
from typing import NamedTuple

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.queue import format as fmt
from threefs.queue.format import BatchBuilder, IndexEntry
from threefs.queue.log import (DEFAULT_ROOT, SEGMENT_AGE_S_MAX, PartitionLog, check_topic_name,
                               load_topic, run)

log = logging.getLogger(__name__)

BATCH_BYTES_DEFAULT = 1 << 20
LINGER_MS_DEFAULT = 5
BUFFER_BYTES_DEFAULT = 64 << 20
DELIVERY_TIMEOUT_S_DEFAULT = 120.0
RETENTION_CHECK_S_DEFAULT = 60.0
PERMANENT_CODES = frozenset({StatusCode.EXISTS, StatusCode.PERMISSION_DENIED, StatusCode.NOT_FOUND,
                             StatusCode.INVALID_ARGUMENT, StatusCode.NOT_DIRECTORY, StatusCode.NO_SPACE})
RETRY_BACKOFF_S = 0.05
CONFLICT_PROBE = 16  # entries read at once after losing a seq to another producer
SEGMENT_SCAN_PIECE = 8 << 20
PRODUCER_ID_RE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
SEALED, WRITTEN, DONE = 0, 1, 2


class RecordMetadata(NamedTuple):
    topic: str
    partition: int
    offset: int
    timestamp_ms: int


class _Batch:
    __slots__ = ("builder", "data", "state", "segment", "position", "attr", "entry", "error", "event",
                 "sealed_at", "topic", "partition", "accounted")

    def __init__(self, topic: str, partition: int):
        self.builder = BatchBuilder()
        self.data = None
        self.state = SEALED
        self.segment = ""
        self.position = -1
        self.attr = None  # the segment's attributes, for the write
        self.accounted = 0  # bytes counted against buffer_bytes
        self.entry: IndexEntry | None = None
        self.error: BaseException | None = None
        self.event = threading.Event()
        self.sealed_at = 0.0
        self.topic, self.partition = topic, partition


class RecordFuture:
    """The outcome of one send(): get() returns RecordMetadata or raises why the record was not stored."""

    __slots__ = ("_batch", "_index", "_timestamp_ms")

    def __init__(self, batch: _Batch, index: int, timestamp_ms: int):
        self._batch, self._index, self._timestamp_ms = batch, index, timestamp_ms

    def done(self) -> bool:
        return self._batch.event.is_set()

    def get(self, timeout: float | None = None) -> RecordMetadata:
        b = self._batch
        if not b.event.wait(timeout):
            raise status_error(StatusCode.TIMEOUT, f"record to {b.topic}/{b.partition} not acknowledged "
                               f"within {timeout} s (still buffered or being written)")
        if b.error is not None:
            raise b.error
        return RecordMetadata(b.topic, b.partition, b.entry.base_offset + self._index, self._timestamp_ms)


class _Writer:
    """One partition's appends: the producer's current segment there, the next seq and base offset."""

    def __init__(self, fs, root: str, topic: str, partition: int, producer_id: str, segment_bytes: int):
        self.fs = fs
        self.log = PartitionLog(fs, root, topic, partition)
        self.producer_id = producer_id
        self.segment_bytes = segment_bytes
        self.ready = False
        self.open_batch: _Batch | None = None
        self.queue: collections.deque[_Batch] = collections.deque()
        self.segment_no = 0
        self.segment = ""
        self.seg_rsp = None
        self.seg_pos = 0
        self.seg_opened = 0.0
        self.next_seq = 0
        self.next_base = 0
        self.torn_bytes_cut = 0

    # -- start-up (sync, in the sender thread) ----------------------------------------------------------
    def init(self) -> None:
        mine = [n for n in self.fs.listdir(self.log.segments_dir) if n.startswith(self.producer_id + ".")]
        if mine:
            last = max(mine)
            self.segment_no = int(last.rsplit(".", 1)[1])
            self.torn_bytes_cut = repair_segment(self.fs, f"{self.log.segments_dir}/{last}")
        self.next_seq = self.log.end_seq()
        if self.next_seq > 0:
            e = self.log.entry(self.next_seq - 1)
            self.next_base = e.end_offset if e is not None else 0
        run(self.fs, self.roll())
        self.ready = True

    async def roll(self) -> None:
        """Close the current segment (publishing its length) and create the next, exclusively (a name is
        never written by two producers)."""
        aio = self.fs.aio
        if self.seg_rsp is not None:
            await aio.close_file(self.seg_rsp.attr.inode, self.seg_rsp.session, self.seg_pos)
            self.seg_rsp = None
        self.segment_no += 1
        name = f"{self.producer_id}.{self.segment_no:06d}"
        try:
            self.seg_rsp = await aio.open(f"{self.log.segments_dir}/{name}",
                                          os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise status_error(StatusCode.EXISTS, f"segment {name} of {self.log.dir} exists: another "
                               f"producer with id {self.producer_id!r} is running") from None
        self.segment, self.seg_pos, self.seg_opened = name, 0, time.monotonic()

    async def close(self) -> None:
        if self.seg_rsp is not None:
            rsp, self.seg_rsp = self.seg_rsp, None
            await self.fs.aio.close_file(rsp.attr.inode, rsp.session, self.seg_pos)

    # -- one round of the sender (async, on the client's loop) ------------------------------------------
    async def step(self, batches: list[_Batch], deadline_s: float) -> None:
        written = []
        for b in batches:
            if b.state != WRITTEN:
                break
            written.append(b)
        fresh = [b for b in batches if b.state == SEALED]
        unplaced = [b for b in fresh if b.position < 0]
        if unplaced and (self.seg_rsp is None or self.seg_pos > 0 and (  # None: an earlier roll failed
                self.seg_pos + len(unplaced[0].data) > self.segment_bytes
                or time.monotonic() - self.seg_opened > SEGMENT_AGE_S_MAX)):
            await self.roll()
        for b in unplaced:  # what does not fit waits for the next round (and segment)
            if self.seg_pos > 0 and self.seg_pos + len(b.data) > self.segment_bytes:
                break
            b.segment, b.position, b.attr = self.segment, self.seg_pos, self.seg_rsp.attr
            self.seg_pos += len(b.data)
        placed = [b for b in fresh if b.position >= 0]
        await asyncio.gather(self.write_all(placed, deadline_s), self.commit_all(written, deadline_s))

    async def write_all(self, batches: list[_Batch], deadline_s: float) -> None:
        async def one(b: _Batch) -> None:
            try:
                await self.fs.aio.write_at(b.attr, b.position, b.data)
                b.state = WRITTEN
            except ThreeFSError as e:  # the same bytes go to the same place again next round
                if time.monotonic() - b.sealed_at > deadline_s:
                    _fail(b, e)
                else:
                    log.info("write of a batch to %s failed, will retry: %s", self.log.dir, e)
                    await asyncio.sleep(RETRY_BACKOFF_S)
        await asyncio.gather(*(one(b) for b in batches))

    async def commit_all(self, batches: list[_Batch], deadline_s: float) -> None:
        for b in batches:
            try:
                await self.commit(b)
            except ThreeFSError as e:
                if time.monotonic() - b.sealed_at > deadline_s:
                    _fail(b, e)
                    continue
                log.info("publishing a batch of %s failed, will retry: %s", self.log.dir, e)
                await asyncio.sleep(RETRY_BACKOFF_S)
                return  # the rest wait for this one: the order of a producer's batches is kept

    async def commit(self, b: _Batch) -> None:
        aio = self.fs.aio
        nbytes = len(b.data)
        while True:
            entry = IndexEntry(b.segment, b.position, nbytes, b.builder.count, self.next_base,
                               b.builder.last_timestamp_ms)
            path = self.log.entry_path(self.next_seq)
            try:
                await aio.symlink(entry.encode(), path)
            except FileExistsError:
                if await self._catch_up(b):
                    return
                continue
            except ThreeFSError as e:
                if e.code not in (StatusCode.UNAVAILABLE, StatusCode.TIMEOUT):
                    raise
                if await self._catch_up(b):  # a lost reply: the entry may be ours
                    return
                raise
            self._done(b, entry)
            return

    async def _catch_up(self, b: _Batch) -> bool:
        """Another producer took next_seq (or a reply was lost): read what is there and move past it.
        True if one of the entries is this batch's (a retried call had gone through)."""
        seqs = list(range(self.next_seq, self.next_seq + CONFLICT_PROBE))
        attrs = await self.fs.aio.batch_stat([self.log.entry_path(s) for s in seqs], follow=False)
        for s, a in zip(seqs, attrs):
            if isinstance(a, FileNotFoundError):
                break
            if isinstance(a, ThreeFSError):
                raise a
            e = IndexEntry.decode(a.symlink_target)
            if e.segment == b.segment and e.position == b.position:
                self._done(b, e)
                return True
            self.next_seq, self.next_base = s + 1, e.end_offset
        return False

    def _done(self, b: _Batch, entry: IndexEntry) -> None:
        self.next_seq += 1
        self.next_base = entry.end_offset
        b.entry, b.state, b.data = entry, DONE, None
        b.event.set()


def _fail(b: _Batch, e: BaseException) -> None:
    b.error, b.state, b.data = e, DONE, None
    b.event.set()


def repair_segment(fs, path: str) -> int:
    """Cut a torn tail: find where the last valid batch ends (every batch header's CRC covers its bytes)
    and truncate there. Returns the bytes cut. Runs when a producer restarts with the same id."""
    with fs.open(path, "ab", buffering=0):  # opening for append measures the true length on storage
        pass
    length = fs.stat(path).length
    buf = bytearray(length)
    view = memoryview(buf)
    for off in range(0, length, SEGMENT_SCAN_PIECE):
        fs.batch_read([(path, off, view[off:off + SEGMENT_SCAN_PIECE])])
    pos = 0
    while pos < length:
        span = fmt.batch_span(view[pos:])
        if span == 0:
            break
        pos += span
    if pos < length:
        log.warning("%s: cut a torn tail of %d bytes at %d", path, length - pos, pos)
        fs.truncate(path, pos)
    return length - pos


class Producer:
    """Appends records to topics; thread-safe (many threads may send)."""

    def __init__(self, fs, *, root: str = DEFAULT_ROOT, producer_id: str | None = None,
                 batch_bytes: int = BATCH_BYTES_DEFAULT, linger_ms: float = LINGER_MS_DEFAULT,
                 buffer_bytes: int = BUFFER_BYTES_DEFAULT, max_block_s: float = 60.0,
                 delivery_timeout_s: float = DELIVERY_TIMEOUT_S_DEFAULT,
                 retention_check_s: float | None = RETENTION_CHECK_S_DEFAULT):
        named = producer_id is not None
        if producer_id is None:
            producer_id = uuid.uuid4().hex[:16]
        if not producer_id or len(producer_id) > 64 or not set(producer_id) <= PRODUCER_ID_RE_CHARS:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"producer_id {producer_id!r}: use 1-64 "
                               "characters of A-Z a-z 0-9 _ -")
        if not (fmt.BATCH_HEADER_BYTES < batch_bytes <= (64 << 20)) or buffer_bytes < batch_bytes:
            raise status_error(StatusCode.INVALID_ARGUMENT, "batch_bytes must be 1 B .. 64 MiB and at most "
                               "buffer_bytes")
        self.fs, self.root, self.producer_id = fs, root, producer_id
        self.batch_bytes, self.linger_s, self.buffer_bytes = batch_bytes, linger_ms / 1000, buffer_bytes
        self.max_block_s, self.delivery_timeout_s = max_block_s, delivery_timeout_s
        self.retention_check_s = retention_check_s  # None: never (leave it to Admin / the CLI)
        self._last_retention = time.monotonic()
        self._configs: dict[str, object] = {}
        self._topics: dict[str, int] = {}
        self._segment_bytes: dict[str, int] = {}
        self._writers: dict[tuple[str, int], _Writer] = {}
        self._sticky: dict[str, int] = {}
        self._cond = threading.Condition(threading.Lock())
        self._buffered = 0
        self._closing = False
        self._error: BaseException | None = None
        self._lease = None
        if named:  # a fixed id may be reused after a crash: make sure its previous holder is gone
            from threefs.queue.lease import ProducerLease

            self._lease = ProducerLease(fs, root, producer_id, self._lease_lost)
            self._lease.acquire()
        self._sender = threading.Thread(target=self._sender_main, name="threefs-queue-sender", daemon=True)
        self._sender.start()

    # -- the API ---------------------------------------------------------------------------------------
    def partitions_for(self, topic: str) -> int:
        n = self._topics.get(topic)
        if n is None:
            config = load_topic(self.fs, self.root, check_topic_name(topic))
            self._topics[topic], self._segment_bytes[topic] = config.partitions, config.segment_bytes
            self._configs[topic] = config
            n = config.partitions
        return n

    def send(self, topic: str, value, key=None, partition: int | None = None,
             timestamp_ms: int | None = None, headers=None) -> RecordFuture:
        """Buffer one record; the future resolves when it is stored (RecordMetadata) or failed."""
        if type(value) is not bytes or (key is not None and type(key) is not bytes) or headers is not None \
                or len(value) > fmt.RECORD_BYTES_MAX:
            value, key = fmt.check_record_input(value, key, headers)
        n = self._topics.get(topic) or self.partitions_for(topic)
        if partition is None:
            partition = zlib.crc32(key) % n if key is not None else self._sticky.get(topic, 0) % n
        elif type(partition) is not int or not 0 <= partition < n:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"partition {partition!r} of {topic}: it has "
                               f"partitions 0..{n - 1}")
        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        with self._cond:
            if self._closing or self._error is not None:
                self._check_open()
            if self._buffered + len(value) > self.buffer_bytes:
                self._wait_for_space(len(value))
            w = self._writers.get((topic, partition))
            if w is None:
                w = self._writers[(topic, partition)] = _Writer(self.fs, self.root, topic, partition,
                                                                self.producer_id, self._segment_bytes[topic])
            b = w.open_batch
            if b is None:
                b = w.open_batch = _Batch(topic, partition)
                b.sealed_at = time.monotonic()  # opened at; sealing resets it
                self._cond.notify_all()  # the sender may sleep without a deadline
            builder = b.builder
            added = builder.append(value, key, ts, headers)
            b.accounted += added
            self._buffered += added
            fut = RecordFuture(b, builder.count - 1, ts)
            if len(builder.buf) >= self.batch_bytes or builder.count >= fmt.BATCH_RECORDS_MAX:
                self._seal(w)
                if key is None:
                    self._sticky[topic] = self._sticky.get(topic, 0) + 1
                self._cond.notify_all()
        return fut

    def flush(self, timeout: float | None = None) -> None:
        """Send everything buffered now and wait until it is stored (or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            for w in self._writers.values():
                if w.open_batch is not None:
                    self._seal(w)
            pending = [b for w in self._writers.values() for b in w.queue]
            self._cond.notify_all()
        for b in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not b.event.wait(left):
                raise status_error(StatusCode.TIMEOUT, f"flush: records still not stored after {timeout} s")
        if self._error is not None:
            raise self._error

    def close(self, timeout: float | None = 60.0) -> None:
        if self._closing:
            return
        try:
            if self._error is None:
                self.flush(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._sender.join(timeout)
            if self._lease is not None:
                self._lease.release()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------------
    def _lease_lost(self, e: ThreeFSError) -> None:
        with self._cond:
            self._error = e
            for w in self._writers.values():
                for b in w.queue:
                    if b.state != DONE:
                        _fail(b, e)
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closing:
            raise status_error(StatusCode.INVALID_ARGUMENT, "producer is closed")
        if self._error is not None:
            raise self._error

    def _wait_for_space(self, size: int) -> None:
        deadline = time.monotonic() + self.max_block_s
        for w in self._writers.values():
            if w.open_batch is not None:
                self._seal(w)
        self._cond.notify_all()
        while self._buffered + size > self.buffer_bytes and self._buffered > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise status_error(StatusCode.TIMEOUT, f"send blocked {self.max_block_s} s: "
                                   f"{self._buffered} bytes buffered (buffer_bytes {self.buffer_bytes}); "
                                   "storage is slower than the producers or unavailable")
            self._cond.wait(left)
            self._check_open()

    def _seal(self, w: _Writer) -> None:
        b, w.open_batch = w.open_batch, None
        b.data = b.builder.seal(0)
        b.sealed_at = time.monotonic()
        w.queue.append(b)

    def _sender_main(self) -> None:
        try:
            while True:
                work = self._next_work()
                if work is None:
                    break
                if work:
                    self._round(work)
                if self.retention_check_s is not None and \
                        time.monotonic() - self._last_retention >= self.retention_check_s:
                    self._retention()
        except BaseException as e:  # a bug or a dead cluster: fail everything pending, loudly
            log.exception("queue producer sender stopped")
            self._error = e if isinstance(e, ThreeFSError) else status_error(StatusCode.INTERNAL, repr(e))
            with self._cond:
                for w in self._writers.values():
                    if w.open_batch is not None:
                        self._seal(w)
                    for b in w.queue:
                        if b.state != DONE:
                            _fail(b, self._error)
                self._cond.notify_all()
        finally:
            self._close_segments()

    def _next_work(self) -> dict[_Writer, list[_Batch]] | None:
        with self._cond:
            while True:
                if self._error is not None:  # the lease was lost: stop sending
                    return None
                now = time.monotonic()
                wake = None
                for w in self._writers.values():
                    b = w.open_batch
                    if b is not None:
                        due = b.sealed_at + self.linger_s
                        if due <= now or self._closing:
                            self._seal(w)
                        else:
                            wake = due if wake is None else min(wake, due)
                work = {w: list(w.queue) for w in self._writers.values() if w.queue}
                if work:
                    return work
                if self._closing:
                    return None
                self._cond.wait(None if wake is None else max(0.0, wake - now))

    def _round(self, work: dict[_Writer, list[_Batch]]) -> None:
        ready = {}
        for w, bs in work.items():
            if not w.ready:
                try:
                    w.init()
                except ThreeFSError as e:
                    if not self._writer_failed(w, bs, e):
                        time.sleep(RETRY_BACKOFF_S)
                    continue
            ready[w] = bs

        async def guarded(w: _Writer, bs: list[_Batch]):
            try:
                await w.step(bs, self.delivery_timeout_s)
            except ThreeFSError as e:  # opening the next segment failed, say: the batches wait or fail
                if not self._writer_failed(w, bs, e):
                    await asyncio.sleep(RETRY_BACKOFF_S)

        async def all_steps():
            await asyncio.gather(*(guarded(w, bs) for w, bs in ready.items()))
        run(self.fs, all_steps())
        with self._cond:
            for w in work:
                while w.queue and w.queue[0].state == DONE:
                    b = w.queue.popleft()
                    self._buffered -= b.accounted
                    b.builder = None
            self._cond.notify_all()

    def _writer_failed(self, w: _Writer, batches: list[_Batch], e: ThreeFSError) -> bool:
        """A partition's set-up or segment roll failed. Errors a retry cannot fix fail its batches now;
        others (meta or storage unreachable) let them wait, up to delivery_timeout_s."""
        permanent = e.code in PERMANENT_CODES
        log.warning("producer %s, %s: %s%s", self.producer_id, w.log.dir, e,
                    "" if permanent else " (will retry)")
        now = time.monotonic()
        for b in batches:
            if b.state != DONE and (permanent or now - b.sealed_at > self.delivery_timeout_s):
                _fail(b, e)
        return permanent

    def _retention(self) -> None:
        """Apply retention to the partitions this producer writes (every retention_check_s)."""
        from threefs.queue.admin import enforce_partition_retention

        self._last_retention = time.monotonic()
        for (topic, _), w in list(self._writers.items()):
            config = self._configs[topic]
            if w.ready and (config.retention_ms >= 0 or config.retention_bytes >= 0):
                try:
                    enforce_partition_retention(self.fs, w.log, config)
                except ThreeFSError as e:  # retention is housekeeping: the next check tries again
                    log.warning("retention of %s failed: %s", w.log.dir, e)

    def _close_segments(self) -> None:
        for w in self._writers.values():
            try:
                run(self.fs, w.close())
            except ThreeFSError as e:
                log.warning("closing segment %s of %s: %s", w.segment, w.log.dir, e)

