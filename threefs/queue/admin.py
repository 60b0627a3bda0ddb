"""Topics and groups: create, delete, list, describe, and retention by age and size.

Retention (`Admin.enforce_retention`; producers run it every `retention_check_s` for the partitions
they write, and `threefs queue retention` on demand) removes a partition's oldest index entries while
the partition holds more than retention_bytes or their newest record is older than retention_ms — never
the newest entry, which the append protocol needs — and then the segment files no remaining entry
names. A producer's *newest* segment may still be appended to, so it is only removed once its creation is
older than twice the age at which producers roll segments (log.SEGMENT_AGE_S_MAX).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from threefs.common.status import StatusCode, status_error
from threefs.queue.log import (DEFAULT_ROOT, SEGMENT_AGE_S_MAX, PartitionLog, TopicConfig, check_topic_name,
                               create_topic, group_dir, list_topics, load_topic, topic_dir)


@dataclass
class PartitionInfo:
    partition: int
    first_offset: int
    end_offset: int
    batches: int
    bytes: int
    segments: int
    oldest_timestamp_ms: int = 0
    newest_timestamp_ms: int = 0


@dataclass
class GroupInfo:
    group: str
    members: dict[str, list[str]] = field(default_factory=dict)  # member -> topics
    committed: dict[str, int] = field(default_factory=dict)  # "topic.pNNNN" -> offset


class Admin:
    def __init__(self, fs, root: str = DEFAULT_ROOT):
        self.fs, self.root = fs, root

    def create_topic(self, name: str, partitions: int = 1, *, retention_ms: int = TopicConfig.retention_ms,
                     retention_bytes: int = -1, segment_bytes: int = TopicConfig.segment_bytes) -> TopicConfig:
        config = TopicConfig(partitions, retention_ms, retention_bytes, segment_bytes)
        create_topic(self.fs, self.root, name, config)
        return config

    def delete_topic(self, name: str) -> None:
        load_topic(self.fs, self.root, name)
        self.fs.remove_tree(topic_dir(self.root, name))

    def list_topics(self) -> list[str]:
        return list_topics(self.fs, self.root)

    def topic_config(self, name: str) -> TopicConfig:
        return load_topic(self.fs, self.root, name)

    def describe_topic(self, name: str) -> list[PartitionInfo]:
        config = load_topic(self.fs, self.root, name)
        out = []
        for p in range(config.partitions):
            plog = PartitionLog(self.fs, self.root, name, p)
            entries = plog.entries()
            segments = len(self.fs.listdir(plog.segments_dir))
            if entries:
                out.append(PartitionInfo(p, entries[0][1].base_offset, entries[-1][1].end_offset, len(entries),
                                         sum(e.nbytes for _, e in entries), segments,
                                         entries[0][1].last_timestamp_ms, entries[-1][1].last_timestamp_ms))
            else:
                out.append(PartitionInfo(p, 0, 0, 0, 0, segments))
        return out

    def list_groups(self) -> list[str]:
        try:
            return sorted(self.fs.listdir(f"{self.root.rstrip('/')}/.groups"))
        except FileNotFoundError:
            return []

    def describe_group(self, group: str) -> GroupInfo:
        gdir = group_dir(self.root, check_topic_name(group))
        if not self.fs.exists(gdir):
            raise status_error(StatusCode.NOT_FOUND, f"consumer group {group} does not exist under {self.root}")
        info = GroupInfo(group)
        for name in _listdir(self.fs, f"{gdir}/members"):
            try:
                info.members[name] = self.fs.readlink(f"{gdir}/members/{name}").split(",")
            except FileNotFoundError:
                pass
        for name in _listdir(self.fs, f"{gdir}/offsets"):
            if not name.startswith("."):
                try:
                    info.committed[name] = int(self.fs.readlink(f"{gdir}/offsets/{name}").split(":")[0])
                except FileNotFoundError:
                    pass
        return info

    def enforce_retention(self, name: str, now_ms: int | None = None) -> dict[str, int]:
        """Apply the topic's retention now; returns counts of what was removed."""
        config = load_topic(self.fs, self.root, name)
        removed = {"batches": 0, "bytes": 0, "segments": 0}
        for p in range(config.partitions):
            r = enforce_partition_retention(self.fs, PartitionLog(self.fs, self.root, name, p), config, now_ms)
            for k in removed:
                removed[k] += r[k]
        return removed


def enforce_partition_retention(fs, plog: PartitionLog, config: TopicConfig, now_ms: int | None = None) -> dict:
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    entries = plog.entries()
    total = sum(e.nbytes for _, e in entries)
    drop = 0
    while drop < len(entries) - 1:  # the newest entry always stays
        e = entries[drop][1]
        too_old = config.retention_ms >= 0 and e.last_timestamp_ms < now_ms - config.retention_ms
        too_big = config.retention_bytes >= 0 and total > config.retention_bytes
        if not (too_old or too_big):
            break
        total -= e.nbytes
        drop += 1
    removed = {"batches": 0, "bytes": 0, "segments": 0}
    for seq, e in entries[:drop]:  # oldest first: [first, end) stays without holes
        try:
            fs.remove(plog.entry_path(seq))
        except FileNotFoundError:
            pass
        removed["batches"] += 1
        removed["bytes"] += e.nbytes
    named = {e.segment for _, e in entries[drop:]}
    newest: dict[str, str] = {}
    names = fs.listdir(plog.segments_dir)
    for n in names:
        producer = n.rsplit(".", 1)[0]
        newest[producer] = max(newest.get(producer, ""), n)
    for n in names:
        if n in named:
            continue
        if newest[n.rsplit(".", 1)[0]] == n:
            attr = fs.stat(f"{plog.segments_dir}/{n}")
            if now_ms * 1_000_000 - attr.ctime_ns < 2 * SEGMENT_AGE_S_MAX * 1e9:
                continue  # its producer may still be appending to it
        try:
            fs.remove(f"{plog.segments_dir}/{n}")
            removed["segments"] += 1
        except FileNotFoundError:
            pass
        plog.forget_segment(n)
    return removed


def _listdir(fs, path: str) -> list[str]:
    try:
        return fs.listdir(path)
    except FileNotFoundError:
        return []
