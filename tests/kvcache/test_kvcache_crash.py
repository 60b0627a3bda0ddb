"""kill -9 of the meta service and of clients in the middle of puts: after the restart every key the cache
reports present reads back exactly the bytes one writer put (two writers race on the same keys with different
bytes: never torn, never mixed), every acknowledged put is there, and the cache keeps serving."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from threefs.client.client import Client
from threefs.kvcache import KVCache

WORKER = str(Path(__file__).with_name("kv_worker.py"))
N_KEYS = 4000  # 500 batches: the writers are still writing when killed (no eviction: 4096 slots)
DEADLINE_S = 120.0


class Worker:
    """A worker process and its output lines, read by a thread (every wait has a deadline)."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.acked: dict[int, str] = {}
        self.eof = False
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("EOF")

    def next_line(self, deadline: float) -> str:
        if self.eof:
            return "EOF"
        line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
        self.eof = line == "EOF"
        if line.startswith("ACK "):
            _, b, ok = line.split()
            self.acked[int(b)] = ok
        return line

    def wait_put_after(self, acks: int, may_end: bool = False) -> None:
        """Return right after the worker announced a put, once `acks` puts were acknowledged: a kill now
        lands inside a put (reserve, page writes or commit)."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            line = self.next_line(deadline)
            if line in ("EOF", "END"):
                assert may_end, f"worker ended ({line}) before {acks} acks"
                return
            if line.startswith("PUT ") and len(self.acked) >= acks:
                return

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        deadline = time.monotonic() + 30
        while self.next_line(deadline) != "EOF":  # the lines it printed before dying
            pass


def test_kill9_of_service_and_clients_mid_put(private_cluster):
    cluster = private_cluster()
    conf = str(cluster.client_config_path)
    root = "/kv/crash"
    a = Worker("write", conf, root, "A", str(N_KEYS))
    b = Worker("write", conf, root, "B", str(N_KEYS))
    try:
        a.wait_put_after(10)
        cluster.kill("kvcache-1")  # the meta part dies with puts in flight
        time.sleep(0.5)
        cluster.up()  # restarts what is missing: kvcache-1 with its SQLite index
        a.wait_put_after(len(a.acked) + 10)  # the writers ride through the restart
        a.kill()  # a client dies in the middle of a put
        b.wait_put_after(len(b.acked) + 5, may_end=True)
        b.kill()
    finally:
        for w in (a, b):
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(30)
    assert len(a.acked) >= 20 and len(b.acked) >= 1
    result = subprocess.run([sys.executable, WORKER, "read", conf, root, str(N_KEYS), "A,B"],
                            capture_output=True, text=True, timeout=DEADLINE_S)
    lines = result.stdout.split("\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [ln for ln in lines if ln.startswith("BAD")], "a page read back torn or mixed"
    hits = {ln.split()[1] for ln in lines if ln.startswith("HIT")}
    for w in (a, b):
        for batch, ok in w.acked.items():
            for j, flag in enumerate(ok):
                if flag == "1":
                    assert "k%06d" % (batch * 8 + j) in hits, f"acknowledged put of batch {batch} lost"
    with Client.connect(conf) as fs:  # the cache keeps serving: new puts land and read back
        cache = KVCache(fs, root, page_bytes=0, capacity_bytes=0)
        assert cache.batch_put([b"after-1", b"after-2"], [b"x" * 100, b"y" * 200]) == [True, True]
        out = [bytearray(100), bytearray(200)]
        assert cache.batch_get_into([b"after-1", b"after-2"], out) == [100, 200]
        assert out == [b"x" * 100, b"y" * 200]
        stats = cache.stats()
        assert stats["corrupt"] == 0 and stats["pages"] >= len(hits)
