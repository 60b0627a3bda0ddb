"""Consumer: Kafka's client shape — subscribe/assign, poll, commit, seek — over a partition's index.

    c = Consumer(fs, "events", group_id="billing")      # joins the group; partitions are assigned
    while True:
        for tp, records in c.poll(timeout_ms=1000).items():
            for r in records: handle(r.offset, r.key, r.value)
        c.commit()                                      # or enable_auto_commit (the default)

A poll reads the next index entries of every assigned partition in one meta call (a batch stat of their
symlinks), then all their batches in one batch read straight from storage, checks each batch's CRC and
returns the records in partition order. With nothing new it waits (2 ms, doubling to 50 ms, between
looks) until the timeout. Committed offsets are symlinks replaced atomically (rename).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from typing import NamedTuple

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.queue import format as fmt
from threefs.queue.format import ConsumerRecord
from threefs.queue.group import Membership, assign
from threefs.queue.log import (DEFAULT_ROOT, PROBE_MAX, PartitionLog, check_topic_name, group_dir,
                               load_topic, run)

log = logging.getLogger(__name__)

POLL_BACKOFF_S_MIN = 0.002
POLL_BACKOFF_S_MAX = 0.05
FETCH_BYTES_MAX = 64 << 20
LOW_CHECK_S = 1.0  # how often a consumer stuck on a missing entry checks whether retention passed it
# errors a poll waits out (meta or storage unreachable for a moment, a chain being reconfigured)
TRANSIENT_CODES = frozenset({StatusCode.UNAVAILABLE, StatusCode.TIMEOUT, StatusCode.NO_SERVING_TARGET,
                             StatusCode.TARGET_OFFLINE, StatusCode.CHAIN_VERSION_MISMATCH, StatusCode.BUSY})


class TopicPartition(NamedTuple):
    topic: str
    partition: int


class _Cursor:
    """Where a partition is read: fetch_seq (next index entry), position (next offset to return)."""

    __slots__ = ("log", "fetch_seq", "position", "buffer", "low_checked")

    def __init__(self, plog: PartitionLog, seq: int, position: int):
        self.log, self.fetch_seq, self.position = plog, seq, position
        self.buffer: collections.deque[ConsumerRecord] = collections.deque()
        self.low_checked = 0.0


class Consumer:
    """Reads records of subscribed (group) or assigned (manual) partitions. One thread uses it at a time,
    as Kafka's consumer; a background thread keeps the group lease alive."""

    def __init__(self, fs, *topics: str, group_id: str | None = None, root: str = DEFAULT_ROOT,
                 member_id: str | None = None, auto_offset_reset: str = "earliest",
                 enable_auto_commit: bool = True, auto_commit_interval_s: float = 5.0,
                 session_timeout_s: float = 10.0, heartbeat_interval_s: float = 1.0,
                 max_poll_records: int = 10_000, fetch_entries: int = 16, listener=None):
        if auto_offset_reset not in ("earliest", "latest"):
            raise status_error(StatusCode.INVALID_ARGUMENT, "auto_offset_reset is 'earliest' or 'latest', "
                               f"not {auto_offset_reset!r}")
        if not 0 < heartbeat_interval_s < session_timeout_s:
            raise status_error(StatusCode.INVALID_ARGUMENT, "need 0 < heartbeat_interval_s < "
                               "session_timeout_s")
        if not 1 <= fetch_entries <= PROBE_MAX or max_poll_records < 1:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"fetch_entries must be 1..{PROBE_MAX} and "
                               "max_poll_records >= 1")
        self.fs, self.root, self.group_id = fs, root, group_id
        if group_id is not None:
            check_topic_name(group_id)
        self.member_id = member_id or uuid.uuid4().hex[:16]
        self.auto_offset_reset = auto_offset_reset
        self.enable_auto_commit = enable_auto_commit and group_id is not None
        self.auto_commit_interval_s = auto_commit_interval_s
        self.session_timeout_s, self.heartbeat_interval_s = session_timeout_s, heartbeat_interval_s
        self.max_poll_records, self.fetch_entries = max_poll_records, fetch_entries
        self._partitions: dict[str, int] = {}
        self._cursors: dict[TopicPartition, _Cursor] = {}
        self._membership: Membership | None = None
        self._members: dict[str, tuple[str, ...]] = {}
        self._members_gen = 0
        self._applied_gen = -1
        self._hb_thread: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._hb_error: BaseException | None = None
        self._last_commit = time.monotonic()
        self._commit_counter = 0
        self._offsets_dir_made = False
        self.listener = listener  # on_partitions_revoked(set) / on_partitions_assigned(set), as Kafka's
        self._closed = False
        if topics:
            self.subscribe(list(topics))

    # -- subscription and assignment -------------------------------------------------------------------
    def subscribe(self, topics: list[str], listener=None) -> None:
        """Join the group for these topics; partitions are assigned among the group's live members.
        `listener` (Kafka's ConsumerRebalanceListener shape) hears of every change, inside poll()."""
        if listener is not None:
            self.listener = listener
        if self.group_id is None:
            raise status_error(StatusCode.INVALID_ARGUMENT, "subscribe needs a group_id (or use assign())")
        if self._membership is not None:
            raise status_error(StatusCode.INVALID_ARGUMENT, "already subscribed; make a new Consumer to "
                               "change topics")
        for t in topics:
            self._partitions[t] = load_topic(self.fs, self.root, check_topic_name(t)).partitions
        self._membership = Membership(self.fs, self.root, self.group_id, self.member_id, topics,
                                      self.session_timeout_s)
        self._membership.join()
        self._set_members(self._membership.heartbeat())
        self._hb_thread = threading.Thread(target=self._heartbeat_main, name="threefs-queue-heartbeat",
                                           daemon=True)
        self._hb_thread.start()

    def assign(self, partitions: list[TopicPartition]) -> None:
        """Read exactly these partitions (no group membership); positions start at the committed offset
        (with a group_id) or per auto_offset_reset."""
        if self._membership is not None:
            raise status_error(StatusCode.INVALID_ARGUMENT, "this consumer subscribed to a group; "
                               "assign() is for consumers without subscribe()")
        wanted = set()
        for tp in partitions:
            tp = TopicPartition(*tp)
            n = self._partitions.get(tp.topic) or load_topic(self.fs, self.root, tp.topic).partitions
            self._partitions[tp.topic] = n
            if not 0 <= tp.partition < n:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"{tp.topic} has partitions 0..{n - 1}")
            wanted.add(tp)
        self._apply_assignment(wanted)

    def assignment(self) -> set[TopicPartition]:
        self._rebalance_if_needed()
        return set(self._cursors)

    # -- reading ---------------------------------------------------------------------------------------
    def poll(self, timeout_ms: float = 0, max_records: int | None = None) -> dict[TopicPartition, list]:
        """Records of the assigned partitions, in order per partition; waits up to timeout_ms for some."""
        self._check_open()
        deadline = time.monotonic() + max(0.0, timeout_ms) / 1000
        limit = max_records or self.max_poll_records
        backoff = POLL_BACKOFF_S_MIN
        if self.enable_auto_commit and time.monotonic() - self._last_commit >= self.auto_commit_interval_s:
            self.commit()
        while True:
            self._rebalance_if_needed()
            out = self._drain(limit)
            if out:
                return out
            try:
                if self._fetch():
                    continue
            except ThreeFSError as e:  # meta or storage unreachable for a moment: try again until timeout
                if e.code not in TRANSIENT_CODES or time.monotonic() >= deadline:
                    raise
                log.info("poll: %s (will retry)", e)
            left = deadline - time.monotonic()
            if left <= 0:
                return {}
            time.sleep(min(left, backoff))
            backoff = min(backoff * 2, POLL_BACKOFF_S_MAX)

    def _drain(self, limit: int) -> dict[TopicPartition, list]:
        out: dict[TopicPartition, list] = {}
        for tp, c in self._cursors.items():
            if limit <= 0:
                break
            if not c.buffer:
                continue
            buf = c.buffer
            if len(buf) <= limit:
                got = list(buf)
                buf.clear()
            else:
                got = [buf.popleft() for _ in range(limit)]
            limit -= len(got)
            c.position = got[-1].offset + 1
            out[tp] = got
        return out

    def _fetch(self) -> bool:
        """One round: the next entries of every partition with an empty buffer (one batch stat), then
        their batches (one batch read). True if any partition moved on."""
        cursors = [c for c in self._cursors.values() if not c.buffer]
        if not cursors:
            return False
        per = max(1, min(self.fetch_entries, PROBE_MAX // len(cursors)))
        paths, owners = [], []
        for c in cursors[:PROBE_MAX]:
            for s in range(c.fetch_seq, c.fetch_seq + per):
                paths.append(c.log.entry_path(s))
                owners.append((c, s))
        attrs = run(self.fs, self.fs.aio.batch_stat(paths, follow=False))
        plan: list[tuple[_Cursor, int, fmt.IndexEntry]] = []
        blocked: set[int] = set()
        budget = FETCH_BYTES_MAX
        for (c, s), a in zip(owners, attrs):
            if id(c) in blocked:
                continue
            if isinstance(a, FileNotFoundError):
                blocked.add(id(c))
                if s == c.fetch_seq:
                    self._check_passed_by_retention(c)
                continue
            if isinstance(a, ThreeFSError):
                raise a
            e = fmt.IndexEntry.decode(a.symlink_target)
            if budget < e.nbytes and plan:
                blocked.add(id(c))
                continue
            budget -= e.nbytes
            plan.append((c, s, e))
        if not plan:
            return False
        return self._read_batches(plan)

    def _read_batches(self, plan: list[tuple[_Cursor, int, fmt.IndexEntry]]) -> bool:
        items, bufs = [], []
        for c, _, e in plan:
            buf = bytearray(e.nbytes)
            try:
                attr = c.log.segment_attr(e.segment, e.position + e.nbytes)
            except FileNotFoundError:  # retention removed the segment after we read its entry
                c.log.forget_segment(e.segment)
                self._check_passed_by_retention(c, force=True)
                return False
            items.append((attr, e.position, buf))
            bufs.append(buf)
        results = self.fs.batch_read(items, raise_on_error=False)
        progressed = False
        for (c, s, e), buf, r in zip(plan, bufs, results):
            if s != c.fetch_seq:  # an earlier batch of this partition failed: keep the order
                continue
            if isinstance(r, BaseException):
                if not isinstance(r, ThreeFSError) or r.code not in TRANSIENT_CODES:
                    raise r
                log.info("reading %s seq %d failed (will retry): %s", c.log.dir, s, r)
                continue
            records = fmt.decode_batch(memoryview(bytes(buf)), e, f"{c.log.dir} seq {s}", c.log.topic,
                                       c.log.partition)
            if e.base_offset < c.position:
                records = [r for r in records if r.offset >= c.position]
            c.buffer.extend(records)
            c.fetch_seq = s + 1
            progressed = True  # also when every record was below the position (after a seek)
        return progressed

    def _check_passed_by_retention(self, c: _Cursor, force: bool = False) -> None:
        """A missing entry is usually one not written yet; but if retention removed it, jump ahead."""
        now = time.monotonic()
        if not force and now - c.low_checked < LOW_CHECK_S:
            return
        c.low_checked = now
        first = c.log.first_seq()
        if first is not None and first > c.fetch_seq:
            e = c.log.entry(first)
            if e is not None:
                log.warning("%s: offsets %d..%d were removed by retention before they were read",
                            c.log.dir, c.position, e.base_offset - 1)
                c.fetch_seq, c.position = first, e.base_offset

    # -- positions and commits -------------------------------------------------------------------------
    def position(self, tp: TopicPartition) -> int:
        return self._cursor(tp).position

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Replay from any offset (offsets older than retention start at the oldest kept)."""
        if not isinstance(offset, int) or offset < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"offset must be an int >= 0, not {offset!r}")
        c = self._cursor(tp)
        c.fetch_seq, c.position = c.log.find_offset(offset, c.fetch_seq)
        c.buffer.clear()

    def seek_to_beginning(self, *tps: TopicPartition) -> None:
        for tp in tps or list(self._cursors):
            self.seek(tp, 0)

    def seek_to_end(self, *tps: TopicPartition) -> None:
        for tp in tps or list(self._cursors):
            c = self._cursor(tp)
            c.fetch_seq, c.position = c.log.end_offset()
            c.buffer.clear()

    def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {TopicPartition(*tp): self._log(TopicPartition(*tp)).end_offset()[1] for tp in tps}

    def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        out = {}
        for tp in tps:
            tp = TopicPartition(*tp)
            plog = self._log(tp)
            first = plog.first_seq()
            e = plog.entry(first) if first is not None else None
            out[tp] = e.base_offset if e else 0
        return out

    def commit(self, offsets: dict[TopicPartition, int] | None = None) -> None:
        """Store committed offsets (default: the positions, i.e. after every record poll returned)."""
        if self.group_id is None:
            raise status_error(StatusCode.INVALID_ARGUMENT, "commit needs a group_id")
        if offsets is None:
            offsets = {tp: c.position for tp, c in self._cursors.items()}
        odir = f"{group_dir(self.root, self.group_id)}/offsets"
        if not self._offsets_dir_made:
            self.fs.mkdir(odir, parents=True, exist_ok=True)
            self._offsets_dir_made = True
        aio = self.fs.aio

        async def one(tp: TopicPartition, offset: int) -> None:
            if not isinstance(offset, int) or offset < 0:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"offset for {tp} must be an int >= 0")
            c = self._cursors.get(tp)
            hint = c.fetch_seq if c is not None and c.position == offset and not c.buffer else -1
            self._commit_counter += 1
            tmp = f"{odir}/.c.{self.member_id}.{self._commit_counter}"
            await aio.symlink(f"{offset}:{hint}", tmp)
            await aio.rename(tmp, f"{odir}/{_offset_name(tp)}")

        async def all_commits():
            await asyncio.gather(*(one(TopicPartition(*tp), off) for tp, off in offsets.items()))
        run(self.fs, all_commits())
        self._last_commit = time.monotonic()

    def committed(self, tp: TopicPartition) -> int | None:
        got = self._committed(TopicPartition(*tp))
        return None if got is None else got[0]

    def _committed(self, tp: TopicPartition) -> tuple[int, int] | None:
        if self.group_id is None:
            return None
        try:
            target = self.fs.readlink(f"{group_dir(self.root, self.group_id)}/offsets/{_offset_name(tp)}")
        except FileNotFoundError:
            return None
        offset, hint = target.split(":")
        return int(offset), int(hint)

    def close(self, commit: bool | None = None) -> None:
        """Leave the group (after committing positions, with auto commit), so others take over at once."""
        if self._closed:
            return
        try:
            if commit if commit is not None else self.enable_auto_commit:
                self.commit()
        finally:
            self._closed = True
            self._hb_stop.set()
            if self._hb_thread is not None:
                self._hb_thread.join(timeout=self.session_timeout_s)
            if self._membership is not None:
                self._membership.leave()

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise status_error(StatusCode.INVALID_ARGUMENT, "consumer is closed")
        if self._hb_error is not None:
            raise self._hb_error

    def _log(self, tp: TopicPartition) -> PartitionLog:
        c = self._cursors.get(tp)
        return c.log if c is not None else PartitionLog(self.fs, self.root, tp.topic, tp.partition)

    def _cursor(self, tp: TopicPartition) -> _Cursor:
        tp = TopicPartition(*tp)
        self._rebalance_if_needed()
        c = self._cursors.get(tp)
        if c is None:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{tp.topic}/{tp.partition} is not assigned to "
                               f"this consumer (assigned: {sorted(self._cursors)})")
        return c

    def _heartbeat_main(self) -> None:
        failures_since = None
        while not self._hb_stop.wait(self.heartbeat_interval_s):
            try:
                self._set_members(self._membership.heartbeat())
                failures_since = None
            except ThreeFSError as e:  # meta unreachable: keep trying; others may expire us meanwhile
                failures_since = failures_since or time.monotonic()
                log.warning("group heartbeat failed: %s", e)
            except BaseException as e:  # a bug: surface it in poll()
                self._hb_error = e
                return

    def _set_members(self, members: dict[str, tuple[str, ...]]) -> None:
        if members != self._members:
            self._members = members
            self._members_gen += 1

    def _rebalance_if_needed(self) -> None:
        if self._membership is None or self._applied_gen == self._members_gen:
            return
        gen = self._members_gen
        mine = assign(self._partitions, self._members).get(self.member_id, [])
        self._apply_assignment({TopicPartition(*tp) for tp in mine})
        self._applied_gen = gen

    def _apply_assignment(self, wanted: set[TopicPartition]) -> None:
        revoked = [tp for tp in self._cursors if tp not in wanted]
        if revoked and self.enable_auto_commit:
            try:
                self.commit({tp: self._cursors[tp].position for tp in revoked})
            except ThreeFSError as e:  # the next owner starts earlier: duplicates, not a loss
                log.warning("committing revoked partitions failed: %s", e)
        for tp in revoked:
            del self._cursors[tp]
        if revoked and self.listener is not None:
            self.listener.on_partitions_revoked(set(revoked))
        added = sorted(wanted - set(self._cursors))
        for tp in added:
            plog = PartitionLog(self.fs, self.root, tp.topic, tp.partition)
            committed = self._committed(tp)
            if committed is not None:
                seq, pos = plog.find_offset(committed[0], committed[1] if committed[1] >= 0 else None)
            elif self.auto_offset_reset == "earliest":
                seq, pos = plog.find_offset(0)
            else:
                seq, pos = plog.end_offset()
            self._cursors[tp] = _Cursor(plog, seq, pos)
        if revoked or added:
            log.info("member %s: partitions %s", self.member_id, sorted(self._cursors))
        if added and self.listener is not None:
            self.listener.on_partitions_assigned(set(added))


def _offset_name(tp: TopicPartition) -> str:
    return f"{tp.topic}.p{tp.partition:04d}"
