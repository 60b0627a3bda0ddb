"""A KVCache client process for the crash and multi-host tests (`python kv_worker.py CMD CONF ROOT ...`):

    write CONF ROOT TAG N_KEYS      put keys k0..k{N-1} in batches of BATCH, each page = content(key, TAG);
                                    prints "PUT i" before batch i and "ACK i <0/1 per key>" after it returned
    read CONF ROOT N_KEYS TAGS      get every key; prints "HIT key tag" per key whose bytes are exactly
                                    content(key, tag) for one of TAGS (comma separated), "BAD key" otherwise,
                                    then "DONE hits"
"""

from __future__ import annotations

import sys

import numpy as np

from threefs.client.client import Client
from threefs.kvcache import KVCache

PAGE = 16 << 10
CAPACITY = 4096 * PAGE
BATCH = 8


def content(key: bytes, tag: str) -> bytes:
    seed = int.from_bytes(key[-6:].ljust(6, b"\0"), "little") * 1000 + sum(tag.encode())
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8).tobytes()


def key_of(i: int) -> bytes:
    return b"k%06d" % i


def write(fs, root: str, tag: str, n: int) -> None:
    cache = KVCache(fs, root, page_bytes=PAGE, capacity_bytes=CAPACITY)
    for b, start in enumerate(range(0, n, BATCH)):
        keys = [key_of(i) for i in range(start, min(n, start + BATCH))]
        pages = [content(k, tag) for k in keys]
        print(f"PUT {b}", flush=True)
        ok = cache.batch_put(keys, pages)
        print(f"ACK {b} {''.join('1' if x else '0' for x in ok)}", flush=True)
    print("END", flush=True)


def read(fs, root: str, n: int, tags: list[str]) -> None:
    cache = KVCache(fs, root, page_bytes=PAGE, capacity_bytes=CAPACITY)
    hits = 0
    for start in range(0, n, 64):
        keys = [key_of(i) for i in range(start, min(n, start + 64))]
        bufs = [bytearray(PAGE) for _ in keys]
        for k, got, buf in zip(keys, cache.batch_get_into(keys, bufs), bufs):
            if got < 0:
                continue
            match = [t for t in tags if bytes(buf[:got]) == content(k, t)]
            print(f"HIT {k.decode()} {match[0]}" if match else f"BAD {k.decode()}", flush=True)
            hits += 1
    print(f"DONE {hits}", flush=True)


def main() -> None:
    cmd, conf, root = sys.argv[1:4]
    with Client.connect(conf) as fs:
        if cmd == "write":
            write(fs, root, sys.argv[4], int(sys.argv[5]))
        elif cmd == "read":
            read(fs, root, int(sys.argv[4]), sys.argv[5].split(","))
        else:
            raise SystemExit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
