"""Processes of the queue tests (`python queue_proc.py ROLE CONF ...`), one client each:

    produce CONF ROOT TOPIC NAME COUNT BATCH_BYTES [PARTITION]
        send COUNT records "NAME-i" (i in order), printing "ACK partition offset NAME-i" as each future
        resolves, "FAIL i code" for records not stored; then "DONE"
    produce-until CONF ROOT TOPIC NAME STOP
        like produce, until the file STOP exists (records of 1 KiB-ish, sent in order)
    consume CONF ROOT TOPIC GROUP MEMBER STOP
        join GROUP, print "ASSIGNED p,p,..." whenever its partitions change (from a rebalance listener) and
        "GOT partition offset value" for every record a poll returns (before the commit that follows), until the file STOP
        exists; then close (commit, leave)
    create CONF ROOT TOPIC PARTITIONS
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from threefs.client.client import Client  # noqa: E402
from threefs.common.status import ThreeFSError  # noqa: E402
from threefs.queue import Consumer, Producer  # noqa: E402

DEADLINE_S = 120.0


def produce(fs, root, topic, name, count, batch_bytes, partition=None):
    with Producer(fs, root=root, batch_bytes=int(batch_bytes), linger_ms=1) as p:
        futures = [p.send(topic, f"{name}-{i}".encode(), key=name.encode() if partition is None else None,
                          partition=None if partition is None else int(partition))
                   for i in range(int(count))]
        for i, f in enumerate(futures):
            try:
                m = f.get(timeout=DEADLINE_S)
                print(f"ACK {m.partition} {m.offset} {name}-{i}", flush=True)
            except ThreeFSError as e:
                print(f"FAIL {i} {e.code.name}", flush=True)
    print("DONE", flush=True)


def produce_until(fs, root, topic, name, stop):
    pad = "x" * 1000
    with Producer(fs, root=root, linger_ms=2, delivery_timeout_s=DEADLINE_S) as p:
        i = 0
        pending = []
        while not os.path.exists(stop):
            for _ in range(20):
                pending.append((i, p.send(topic, f"{name}-{i}-{pad}".encode(), key=f"{name}{i % 7}".encode())))
                i += 1
            still = []
            for j, f in pending:
                if f.done():
                    _report(name, j, f)
                else:
                    still.append((j, f))
            pending = still
            time.sleep(0.01)
        p.flush(DEADLINE_S)
        for j, f in pending:
            _report(name, j, f)
    print("DONE", flush=True)


def _report(name, i, f):
    try:
        m = f.get(timeout=DEADLINE_S)
        print(f"ACK {m.partition} {m.offset} {name}-{i}", flush=True)
    except ThreeFSError as e:
        print(f"FAIL {i} {e.code.name}", flush=True)


class _PrintChanges:
    """A rebalance listener: prints the partitions owned after every change, at the moment it happens
    (inside poll, before the records that poll returns), so the test knows where a partition restarts."""

    def __init__(self):
        self.owned: set[int] = set()

    def on_partitions_revoked(self, revoked):
        self.owned -= {tp.partition for tp in revoked}
        self._print()

    def on_partitions_assigned(self, assigned):
        self.owned |= {tp.partition for tp in assigned}
        self._print()

    def _print(self):
        print(f"ASSIGNED {','.join(map(str, sorted(self.owned)))}", flush=True)


def consume(fs, root, topic, group, member, stop):
    c = Consumer(fs, group_id=group, root=root, member_id=member, session_timeout_s=3.0,
                 heartbeat_interval_s=0.3, enable_auto_commit=False)
    c.subscribe([topic], listener=_PrintChanges())
    print("JOINED", flush=True)
    while not os.path.exists(stop):
        try:
            c.assignment()  # applies a new view of the group even when no record comes
            got = c.poll(timeout_ms=200)
            for tp, records in got.items():
                for r in records:
                    print(f"GOT {tp.partition} {r.offset} {r.value.decode().split('-x')[0]}", flush=True)
            if got:
                c.commit()
        except ThreeFSError as e:  # a storage service died: the next poll tries again
            print(f"ERR {e.code.name} {e}", file=sys.stderr, flush=True)
            time.sleep(0.1)
    c.close()
    print("DONE", flush=True)


def create(fs, root, topic, partitions):
    from threefs.queue import Admin

    Admin(fs, root).create_topic(topic, int(partitions))
    print("CREATED", flush=True)


def main() -> None:
    role, conf, *rest = sys.argv[1:]
    fs = Client.connect(conf)
    try:
        {"produce": produce, "produce-until": produce_until, "consume": consume, "create": create}[role](fs, *rest)
    finally:
        fs.close()


if __name__ == "__main__":
    main()
