"""`threefs queue ...`: topics and consumer groups of threefs.queue.

    threefs queue create TOPIC --partitions N [--retention-ms MS] [--retention-bytes B]
    threefs queue ls                      topics (partitions, records, bytes) and consumer groups
    threefs queue describe TOPIC|--group G    per partition: offsets, batches, bytes; a group's members, lag
    threefs queue tail TOPIC [-p P] [-n N] [-f]   the last N records (with -f: then follow, like tail -f)
    threefs queue produce TOPIC [--key K]  one record per line of stdin
    threefs queue retention TOPIC         apply the topic's retention now
    threefs queue delete TOPIC

`--root` (default /queues) picks the directory holding the topics.
"""

from __future__ import annotations

import datetime
import json
import sys

from threefs.common.status import StatusCode, status_error

TAIL_POLL_MS = 500


def _client(args):
    from threefs.client.client import Client

    return Client.connect(args.config)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _when(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S") if ms else "-"


def cmd_create(args) -> int:
    from threefs.queue import Admin

    with _client(args) as fs:
        c = Admin(fs, args.root).create_topic(args.topic, args.partitions, retention_ms=args.retention_ms,
                                              retention_bytes=args.retention_bytes)
    print(f"created topic {args.topic}: {c.partitions} partition(s), retention "
          f"{'forever' if c.retention_ms < 0 else f'{c.retention_ms} ms'}, "
          f"{'no size limit' if c.retention_bytes < 0 else _human(c.retention_bytes) + ' per partition'}")
    return 0


def cmd_ls(args) -> int:
    from threefs.queue import Admin

    with _client(args) as fs:
        admin = Admin(fs, args.root)
        rows = []
        for t in admin.list_topics():
            parts = admin.describe_topic(t)
            rows.append({"topic": t, "partitions": len(parts),
                         "records": sum(p.end_offset - p.first_offset for p in parts),
                         "bytes": sum(p.bytes for p in parts)})
        groups = admin.list_groups()
    if args.json:
        print(json.dumps({"topics": rows, "groups": groups}, indent=2))
        return 0
    if not rows:
        print(f"no topics under {args.root}")
    for r in rows:
        print(f"{r['topic']:30s} {r['partitions']:>4} partition(s) {r['records']:>12,} records "
              f"{_human(r['bytes']):>11}")
    for g in groups:
        print(f"group {g}")
    return 0


def cmd_describe(args) -> int:
    from threefs.queue import Admin

    with _client(args) as fs:
        admin = Admin(fs, args.root)
        if args.group:
            return _describe_group(admin, args)
        if not args.topic:
            raise status_error(StatusCode.INVALID_ARGUMENT, "describe needs a TOPIC or --group G")
        config = admin.topic_config(args.topic)
        parts = admin.describe_topic(args.topic)
    if args.json:
        print(json.dumps({"config": vars(config), "partitions": [vars(p) for p in parts]}, indent=2))
        return 0
    print(f"topic {args.topic}: {config.partitions} partition(s), retention_ms {config.retention_ms}, "
          f"retention_bytes {config.retention_bytes}, segment_bytes {config.segment_bytes}")
    print(f"{'part':>4} {'first':>12} {'end':>12} {'batches':>8} {'bytes':>11} {'segs':>4}  newest record")
    for p in parts:
        print(f"{p.partition:>4} {p.first_offset:>12} {p.end_offset:>12} {p.batches:>8} {_human(p.bytes):>11} "
              f"{p.segments:>4}  {_when(p.newest_timestamp_ms)}")
    return 0


def _describe_group(admin, args) -> int:
    info = admin.describe_group(args.group)
    ends = {}
    for name in info.committed:
        topic, part = name.rsplit(".p", 1)
        try:
            ends[name] = next(p.end_offset for p in admin.describe_topic(topic) if p.partition == int(part))
        except Exception:  # the topic was deleted: no lag to show
            ends[name] = None
    if args.json:
        print(json.dumps({"group": info.group, "members": info.members, "committed": info.committed,
                          "end": ends}, indent=2))
        return 0
    print(f"group {info.group}: {len(info.members)} live member(s)")
    for m, topics in sorted(info.members.items()):
        print(f"  member {m}: {','.join(topics)}")
    for name, off in sorted(info.committed.items()):
        end = ends.get(name)
        print(f"  {name:30s} committed {off:>12}  end {end if end is not None else '-':>12}  "
              f"lag {end - off if end is not None else '-'}")
    return 0


def cmd_tail(args) -> int:
    from threefs.queue import Consumer, TopicPartition

    if args.n < 0:
        raise status_error(StatusCode.INVALID_ARGUMENT, "-n must be >= 0")
    with _client(args) as fs:
        c = Consumer(fs, root=args.root)
        from threefs.queue.log import load_topic

        parts = range(load_topic(fs, args.root, args.topic).partitions) if args.partition is None \
            else [args.partition]
        tps = [TopicPartition(args.topic, p) for p in parts]
        c.assign(tps)
        ends = c.end_offsets(tps)
        for tp in tps:
            c.seek(tp, max(0, ends[tp] - args.n))
        left = {tp: ends[tp] - c.position(tp) for tp in tps}
        try:
            while True:
                got = c.poll(timeout_ms=TAIL_POLL_MS)
                for tp, records in got.items():
                    for r in records:
                        if not args.follow and left[tp] <= 0:
                            continue
                        left[tp] -= 1
                        _print_record(r, args)
                if not args.follow and all(v <= 0 for v in left.values()):
                    return 0
                if not args.follow and not got:
                    return 0
        except KeyboardInterrupt:
            return 0
        finally:
            c.close(commit=False)


def _print_record(r, args) -> None:
    value = r.value.decode("utf-8", "backslashreplace")
    key = r.key.decode("utf-8", "backslashreplace") if r.key is not None else ""
    if args.json:
        print(json.dumps({"partition": r.partition, "offset": r.offset, "timestamp_ms": r.timestamp_ms,
                          "key": key if r.key is not None else None, "value": value}), flush=True)
    else:
        print(f"{r.partition}:{r.offset} {_when(r.timestamp_ms)} {key + ' ' if key else ''}{value}", flush=True)


def cmd_produce(args) -> int:
    from threefs.queue import Producer

    with _client(args) as fs, Producer(fs, root=args.root) as p:
        futures = [p.send(args.topic, line.rstrip("\n").encode(), key=args.key.encode() if args.key else None)
                   for line in sys.stdin]
        p.flush()
        for f in futures:
            f.get()
    print(f"{len(futures)} record(s) stored", file=sys.stderr)
    return 0


def cmd_retention(args) -> int:
    from threefs.queue import Admin

    with _client(args) as fs:
        r = Admin(fs, args.root).enforce_retention(args.topic)
    print(f"removed {r['batches']} batch(es), {_human(r['bytes'])}, {r['segments']} segment file(s)")
    return 0


def cmd_delete(args) -> int:
    from threefs.queue import Admin

    with _client(args) as fs:
        Admin(fs, args.root).delete_topic(args.topic)
    print(f"deleted topic {args.topic}")
    return 0


def add_queue_parser(sub) -> None:
    from threefs.queue.log import DEFAULT_ROOT, RETENTION_MS_DEFAULT

    q = sub.add_parser("queue", help="message queue topics and consumer groups (threefs.queue)")
    q.add_argument("--root", default=DEFAULT_ROOT, help=f"directory of the topics (default {DEFAULT_ROOT})")
    qs = q.add_subparsers(dest="queue_cmd", required=True)
    c = qs.add_parser("create", help="create a topic")
    c.add_argument("topic")
    c.add_argument("--partitions", type=int, default=1)
    c.add_argument("--retention-ms", type=int, default=RETENTION_MS_DEFAULT, help="-1: keep forever")
    c.add_argument("--retention-bytes", type=int, default=-1, help="per partition; -1: no limit")
    c.set_defaults(fn=cmd_create)
    ls = qs.add_parser("ls", help="topics and consumer groups")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=cmd_ls)
    d = qs.add_parser("describe", help="a topic's partitions, or a group's members and lag")
    d.add_argument("topic", nargs="?")
    d.add_argument("--group")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=cmd_describe)
    t = qs.add_parser("tail", help="print the last records of a topic")
    t.add_argument("topic")
    t.add_argument("-p", "--partition", type=int, default=None)
    t.add_argument("-n", type=int, default=10, help="records per partition (default 10)")
    t.add_argument("-f", "--follow", action="store_true", help="keep printing new records until Ctrl-C")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=cmd_tail)
    pr = qs.add_parser("produce", help="send one record per line of stdin")
    pr.add_argument("topic")
    pr.add_argument("--key")
    pr.set_defaults(fn=cmd_produce)
    r = qs.add_parser("retention", help="apply the topic's retention now")
    r.add_argument("topic")
    r.set_defaults(fn=cmd_retention)
    de = qs.add_parser("delete", help="delete a topic and its records")
    de.add_argument("topic")
    de.set_defaults(fn=cmd_delete)
