"""A topic's files on threefs, and the append protocol that gives each partition one order.

    ROOT/TOPIC/topic.json                   partitions, retention (written once by create_topic)
    ROOT/TOPIC/pNNNN/segments/PRODUCER.NNNNNN  record batches, appended by one producer only
    ROOT/TOPIC/pNNNN/index/SSSSSSSSSSSS     symlink: "q1:segment:position:bytes:count:base:last_ts"
    ROOT/.groups/GROUP/members/MEMBER       symlink (target: subscribed topics; mtime: last heartbeat)
    ROOT/.groups/GROUP/offsets/TOPIC.pNNNN  symlink: "committed offset:index seq hint"

Append protocol. A producer writes a batch into its *own* segment file (no other writer touches it, so
there is nothing to lock), waits until storage acknowledged the bytes on every replica of the chain, then
publishes the batch by creating the symlink index/<seq> for the next sequence number — one meta
transaction that fails with EEXIST if another producer took that number first. The winner's batch is then
part of the partition; the loser reads the winning entry (entries never change once created), learns the
next base offset and tries seq + 1. So several producers on several hosts get one order per partition,
offsets are dense (base of seq = base + count of seq - 1) and nothing acknowledged is lost: an offset is
returned to a producer only after its entry exists, and an entry only names bytes that are on storage.
A producer that dies between the write and the symlink leaves bytes no entry names: they are never read
(and a producer restarted with the same id cuts them if they are torn; see Producer).

Entries exist for every seq in [first, end): index/<seq> is only created after index/<seq - 1> was read,
and retention removes entries from the front only and always keeps the newest one.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass

import msgspec

from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.queue.format import IndexEntry

DEFAULT_ROOT = "/queues"
TOPIC_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
PARTITIONS_MAX = 10_000
SEQ_DIGITS = 12
PROBE_MAX = 1024  # names in one batch stat (limits.BATCH_STAT_MAX)
READDIR_PAGE = 1024
SYMLINK = 3  # meta's InodeAttr.type of a symlink
RETENTION_MS_DEFAULT = 7 * 24 * 3600 * 1000
SEGMENT_BYTES_DEFAULT = 64 << 20
SEGMENT_AGE_S_MAX = 600.0  # a producer rolls its segment after this long, so retention may drop idle ones


def run(fs, coro):
    """Run one of the client's async calls (fs.aio) on the client's own loop."""
    return fs.run(coro)


def check_topic_name(name: str) -> str:
    if not isinstance(name, str) or not TOPIC_NAME_RE.match(name) or name in (".", ".."):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"topic name {name!r} is invalid: use 1-200 "
                           "characters of A-Z a-z 0-9 . _ -")
    return name


@dataclass
class TopicConfig:
    partitions: int
    retention_ms: int = RETENTION_MS_DEFAULT  # -1: keep forever
    retention_bytes: int = -1  # per partition; -1: no size limit
    segment_bytes: int = SEGMENT_BYTES_DEFAULT

    def check(self) -> "TopicConfig":
        if not isinstance(self.partitions, int) or not 1 <= self.partitions <= PARTITIONS_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"partitions must be 1..{PARTITIONS_MAX}, "
                               f"not {self.partitions!r}")
        for name in ("retention_ms", "retention_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or (v < 0 and v != -1):
                raise status_error(StatusCode.INVALID_ARGUMENT, f"{name} must be >= 0 or -1 (unlimited), "
                                   f"not {v!r}")
        if not isinstance(self.segment_bytes, int) or not (1 << 16) <= self.segment_bytes <= (1 << 34):
            raise status_error(StatusCode.INVALID_ARGUMENT, "segment_bytes must be 64 KiB .. 16 GiB")
        return self


def topic_dir(root: str, topic: str) -> str:
    return f"{root.rstrip('/')}/{check_topic_name(topic)}"


def partition_dir(root: str, topic: str, partition: int) -> str:
    return f"{topic_dir(root, topic)}/p{partition:04d}"


def group_dir(root: str, group: str) -> str:
    return f"{root.rstrip('/')}/.groups/{check_topic_name(group)}"


def create_topic(fs, root: str, topic: str, config: TopicConfig) -> None:
    """The topic's directories and topic.json (written to a temp name, renamed into place last: a topic
    exists once topic.json does). EXISTS if it is there already."""
    config.check()
    tdir = topic_dir(root, topic)
    fs.mkdir(root, parents=True, exist_ok=True)
    if fs.exists(f"{tdir}/topic.json"):
        raise status_error(StatusCode.EXISTS, f"topic {topic} exists ({tdir})")
    fs.mkdir(tdir, exist_ok=True)
    for p in range(config.partitions):
        pdir = f"{tdir}/p{p:04d}"
        fs.mkdir(pdir, exist_ok=True)
        fs.mkdir(f"{pdir}/index", exist_ok=True)
        fs.mkdir(f"{pdir}/segments", exist_ok=True)
    tmp = f"{tdir}/.topic.json.{os.getpid()}.{time.monotonic_ns()}"
    fs.write_bytes(tmp, json.dumps(asdict(config)).encode())
    try:
        fs.rename(tmp, f"{tdir}/topic.json", noreplace=True)
    except FileExistsError:
        fs.remove(tmp)
        raise status_error(StatusCode.EXISTS, f"topic {topic} exists ({tdir})") from None


def load_topic(fs, root: str, topic: str) -> TopicConfig:
    path = f"{topic_dir(root, topic)}/topic.json"
    try:
        raw = fs.read_bytes(path)
    except FileNotFoundError:
        raise status_error(StatusCode.NOT_FOUND, f"topic {topic} does not exist under {root} (create it "
                           f"with `threefs queue create {topic} --partitions N`)") from None
    return TopicConfig(**json.loads(raw))


def list_topics(fs, root: str) -> list[str]:
    try:
        names = fs.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if not n.startswith(".") and fs.exists(f"{root}/{n}/topic.json"))


def seq_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}"


class PartitionLog:
    """The index and segments of one partition (no state beyond paths and a segment attr cache)."""

    def __init__(self, fs, root: str, topic: str, partition: int):
        self.fs = fs
        self.topic = topic
        self.partition = partition
        self.dir = partition_dir(root, topic, partition)
        self.index_dir = f"{self.dir}/index"
        self.segments_dir = f"{self.dir}/segments"
        self._segment_attrs: dict[str, object] = {}

    def entry_path(self, seq: int) -> str:
        return f"{self.index_dir}/{seq_name(seq)}"

    # -- reading the index -------------------------------------------------------------------------
    def probe(self, seqs: list[int]) -> dict[int, IndexEntry | None]:
        """The entries at `seqs` (None where there is none), one meta call per PROBE_MAX names."""
        out: dict[int, IndexEntry | None] = {}
        for i in range(0, len(seqs), PROBE_MAX):
            part = seqs[i:i + PROBE_MAX]
            attrs = run(self.fs, self.fs.aio.batch_stat([self.entry_path(s) for s in part], follow=False))
            for s, a in zip(part, attrs):
                out[s] = _entry_of(a, self.entry_path(s))
        return out

    def entry(self, seq: int) -> IndexEntry | None:
        return self.probe([seq])[seq]

    def first_seq(self) -> int | None:
        """The oldest entry's seq (None: the partition never had a batch)."""
        rsp = run(self.fs, self.fs.aio.readdir(self.index_dir, "", 1))
        names = [e.name for e in rsp.entries if e.name.isdigit()]
        return int(names[0]) if names else None

    def end_seq(self, known: int | None = None) -> int:
        """The seq the next batch gets: entries exist for [first, end). Galloping from `known` (a seq
        that exists) or the first entry: at most a few batch stats, however long the index."""
        lo = known if known is not None else self.first_seq()
        if lo is None:
            return 0
        cands = [lo + (1 << k) for k in range(48)]  # exponential probes in one call
        found = self.probe(cands)
        hi_missing = next(c for c in cands if found[c] is None)
        lo_ok = max([lo] + [c for c in cands if c < hi_missing])  # exists (no holes above first)
        while hi_missing - lo_ok > 1:  # entries exist below hi_missing's gap: narrow it down
            span = hi_missing - lo_ok - 1
            if span <= PROBE_MAX:
                cands = list(range(lo_ok + 1, hi_missing))
            else:
                stride = span / PROBE_MAX
                cands = sorted({lo_ok + 1 + int(i * stride) for i in range(PROBE_MAX)})
            found = self.probe(cands)
            for c in cands:
                if found[c] is None:
                    hi_missing = c
                    break
                lo_ok = c
        return hi_missing

    def find_offset(self, offset: int, hint_seq: int | None = None) -> tuple[int, int]:
        """(seq, offset) to read `offset` from: the batch holding it; the first batch if it is older than
        the oldest kept (the offset moves up to that batch's base); the end if it is past the end."""
        if hint_seq is not None:
            e = self.entry(hint_seq)
            if e is not None and e.base_offset <= offset < e.end_offset:
                return hint_seq, offset
            if e is not None and offset == e.end_offset:
                nxt = self.entry(hint_seq + 1)
                if nxt is None or nxt.base_offset == offset:
                    return hint_seq + 1, offset
        first = self.first_seq()
        if first is None:
            return 0, 0
        end = self.end_seq(first)
        lo, hi = first, end  # find the last seq whose base <= offset
        first_entry = self.entry(first)
        if first_entry is None:  # retention removed it meanwhile: start again
            return self.find_offset(offset)
        if offset <= first_entry.base_offset:
            return first, first_entry.base_offset
        while hi - lo > 1:
            span = hi - lo - 1
            cands = list(range(lo + 1, hi)) if span <= 64 else sorted({lo + 1 + int(i * span / 64)
                                                                       for i in range(64)})
            found = self.probe(cands)
            new_lo, new_hi = lo, hi
            for c in cands:
                e = found[c]
                if e is None or e.base_offset > offset:
                    new_hi = c
                    break
                new_lo = c
            lo, hi = new_lo, new_hi
        e = self.entry(lo)
        if e is None:  # removed by retention while searching
            return self.find_offset(offset)
        if offset < e.end_offset:
            return lo, offset
        return lo + 1, e.end_offset  # past the end: the end (Kafka would reset; here the end is the answer)

    def end_offset(self) -> tuple[int, int]:
        """(end seq, offset the next record gets)."""
        end = self.end_seq()
        if end == 0:
            return 0, 0
        e = self.entry(end - 1)
        return end, (e.end_offset if e else 0)

    def entries(self) -> list[tuple[int, IndexEntry]]:
        """Every entry, oldest first (readdir pages + batch stats: for describe and retention)."""
        names: list[str] = []
        after = ""
        while True:
            rsp = run(self.fs, self.fs.aio.readdir(self.index_dir, after, READDIR_PAGE))
            names.extend(e.name for e in rsp.entries if e.name.isdigit())
            if not rsp.more or not rsp.entries:
                break
            after = rsp.entries[-1].name
        found = self.probe([int(n) for n in names])
        return [(s, e) for s, e in sorted(found.items()) if e is not None]

    # -- segments ------------------------------------------------------------------------------------
    def segment_attr(self, segment: str, end: int):
        """The segment's attributes with a length of at least `end`: the index entry, not meta's lazy
        length, says which bytes are on storage (the producer is still appending)."""
        attr = self._segment_attrs.get(segment)
        if attr is None:
            attr = self.fs.stat(f"{self.segments_dir}/{segment}")
            self._segment_attrs[segment] = attr
            if len(self._segment_attrs) > 256:
                self._segment_attrs.pop(next(iter(self._segment_attrs)))
        if attr.length < end:
            attr = msgspec.structs.replace(attr, length=end)
            self._segment_attrs[segment] = attr
        return attr

    def forget_segment(self, segment: str) -> None:
        self._segment_attrs.pop(segment, None)


def _entry_of(attr, path: str) -> IndexEntry | None:
    if isinstance(attr, FileNotFoundError):
        return None
    if isinstance(attr, ThreeFSError):
        raise attr
    if attr.type != SYMLINK:
        raise status_error(StatusCode.CHECKSUM_MISMATCH, f"{path} is not a queue index entry (type "
                           f"{attr.type}); the partition directory was modified by hand")
    return IndexEntry.decode(attr.symlink_target)
