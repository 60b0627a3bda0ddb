"""A process of the kvstore race tests: `python kv_proc.py CONF STORE NAME ROUNDS`.

Waits for the file STORE-go (a start barrier, given as the path in argv[5]), then ROUNDS times: increments the
counter key b"counter" with a compare-and-set loop (get, CAS old -> old + 1, again on failure) and appends
NAME to b"log" the same way by version; tries once to become b"leader" (CAS absent -> NAME). Prints
"RETRIES n" and "LEADER yes|no".
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from threefs.client.client import Client  # noqa: E402
from threefs.kvstore import KVStore  # noqa: E402

DEADLINE_S = 120.0


def main() -> None:
    conf, store, name, rounds, go = sys.argv[1:]
    deadline = time.monotonic() + DEADLINE_S
    with Client.connect(conf) as fs:
        kv = KVStore(fs, store)
        while not os.path.exists(go):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        retries = 0
        leader = kv.compare_and_set(b"leader", None, name.encode())
        for _ in range(int(rounds)):
            while True:
                old = kv.get(b"counter")
                if kv.compare_and_set(b"counter", old, b"%d" % (int(old or 0) + 1)):
                    break
                retries += 1
                assert time.monotonic() < deadline
            while True:
                item = kv.get_item(b"log")
                version, value = (item.version, item.value) if item else (0, b"")
                if kv.compare_and_set_version(b"log", version, value + name.encode() + b","):
                    break
                retries += 1
                assert time.monotonic() < deadline
        print(f"RETRIES {retries}")
        print(f"LEADER {'yes' if leader else 'no'}")


if __name__ == "__main__":
    main()
