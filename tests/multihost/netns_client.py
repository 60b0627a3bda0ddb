"""The client side of the netns tests, run inside a client namespace (`ip netns exec NS python THIS ...`):

    ready CONF R STORAGE     create chain table 1 (R replicas) once STORAGE storage nodes registered; wait
                             until every target is SERVING; print the target states as JSON
    states CONF              print {target_id: public_state} once
    storage-nodes CONF       print how many storage nodes are alive
    roundtrip CONF           write a 3 MiB file, read it back, print OK
    load CONF STOP SEED      write files /load/fNNNNN until the file STOP exists; print "ACK i crc" after each
                             close() returned (an acknowledged write), "FAIL i code message" when it raised
    verify CONF ACKS         read every acknowledged file listed in ACKS and compare checksums; print "OK n"
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import crc32c

from threefs.client.client import Client
from threefs.common.status import ThreeFSError
from threefs.rpc.schemas import mgmtd as ms

DEADLINE_S = 90.0


def target_states(fs: Client) -> dict[int, str]:
    routing = fs.run(fs.aio.mgmtd.refresh(force=True))
    return {t.target_id: t.public_state for t in routing.info.targets.values() if t.chain_id}


def ready(fs: Client, replicas: int, storage: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            routing = fs.run(fs.aio.mgmtd.refresh(force=True))
            if len(routing.nodes_of_type(ms.STORAGE)) >= storage and 1 not in routing.info.tables:
                fs.run(fs.aio.mgmtd.call("create_chain_table", ms.CreateChainTableReq(1, replicas),
                                          ms.CreateChainTableRsp))
            states = target_states(fs)
            if 1 in routing.info.tables and states and set(states.values()) == {ms.SERVING}:
                fs.stat("/")
                print(json.dumps(states))
                return
        except ThreeFSError as exc:
            print(f"not ready: {exc}", file=sys.stderr)
        time.sleep(0.3)
    raise SystemExit("cluster not ready")


def load(fs: Client, stop: str, seed: int) -> None:
    rng = random.Random(seed)
    fs.mkdir("/load", exist_ok=True)
    i = 0
    while not os.path.exists(stop):
        data = rng.randbytes(rng.randrange(64 << 10, 1 << 20))
        try:
            with fs.open(f"/load/f{i:05d}", "wb") as f:
                f.write(data)
        except ThreeFSError as exc:  # not acknowledged: the test does not count it
            print(f"FAIL {i} {exc.code.name} {exc}", flush=True)
        else:
            print(f"ACK {i} {crc32c.crc32c(data)}", flush=True)
        i += 1


def verify(fs: Client, acks: str) -> None:
    n = 0
    for line in open(acks):
        _, i, crc = line.split()
        data = fs.read_bytes(f"/load/f{int(i):05d}")
        assert crc32c.crc32c(data) == int(crc), f"file {i}: checksum differs"
        n += 1
    print(f"OK {n}")


def connect(conf: str, command: str) -> Client:
    """`ready` runs right after the services were spawned: mgmtd may not listen yet, so it retries."""
    deadline = time.monotonic() + (DEADLINE_S if command == "ready" else 0)
    while True:
        try:
            return Client.connect(conf)
        except ThreeFSError as exc:
            if time.monotonic() > deadline:
                raise
            print(f"not ready: {exc}", file=sys.stderr)
            time.sleep(0.3)


def main() -> None:
    command, conf, *rest = sys.argv[1:]
    with connect(conf, command) as fs:
        if command == "ready":
            ready(fs, int(rest[0]), int(rest[1]))
        elif command == "storage-nodes":
            routing = fs.run(fs.aio.mgmtd.refresh(force=True))
            print(len(routing.nodes_of_type(ms.STORAGE)))
        elif command == "roundtrip":
            data = bytes(range(256)) * 12345
            with fs.open("/roundtrip", "wb") as f:
                f.write(data)
            assert fs.read_bytes("/roundtrip") == data
            print("OK")
        elif command == "states":
            print(json.dumps(target_states(fs)))
        elif command == "load":
            load(fs, rest[0], int(rest[1]))
        elif command == "verify":
            verify(fs, rest[0])
        else:
            raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()
