"""The reference for threefs's read path: what a minimal file server in plain Python does on this machine.

Three server processes (as three storage services) serve one local file (in the page cache, as storage's
chunks are when a benchmark re-reads them). A request carries up to IOS_PER_REQUEST (offset, length)
pairs; the server `preadv`s them into one preallocated buffer and `sendall`s it. The client keeps one
blocking connection and one thread per server and `recv_into`s a preallocated buffer; a batch of IOs is
dealt to the servers round-robin. No checksums, no replication, no metadata: a ceiling for the software,
not a peer. benchmarks/client_io.py prints threefs's figures as ratios to it.

The transport is the one threefs's clients use on one host: Unix sockets (threefs/common/local_socket.py) unless
THREEFS_RPC_LOCAL=0, then loopback TCP; `RefServers(..., transport=...)` picks one explicitly.

    .venv/bin/python benchmarks/refserver.py FILE [--size 4096] [--seconds 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import struct
import threading
import time

IOS_PER_REQUEST = 64
SERVERS = 3
_HEAD = struct.Struct("<I")  # number of IOs
_IO = struct.Struct("<QI")  # offset, length
_RSP = struct.Struct("<Q")  # bytes that follow


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed")
        view = view[n:]


def _serve(path: str, listener: socket.socket, buf_bytes: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    buf = memoryview(bytearray(buf_bytes))
    head = memoryview(bytearray(_HEAD.size))
    ios = memoryview(bytearray(_IO.size * IOS_PER_REQUEST))
    while True:
        conn, _ = listener.accept()
        if conn.family != socket.AF_UNIX:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                _recv_exact(conn, head)
                (count,) = _HEAD.unpack(head)
                _recv_exact(conn, ios[:count * _IO.size])
                pos = 0
                for offset, length in _IO.iter_unpack(ios[:count * _IO.size]):
                    pos += os.preadv(fd, [buf[pos:pos + length]], offset)
                conn.sendall(_RSP.pack(pos))
                conn.sendall(buf[:pos])
        except (ConnectionError, OSError):
            conn.close()


def default_transport() -> str:
    """What threefs's clients use to reach servers of this host (threefs/common/local_socket.py)."""
    from threefs.common import local_socket

    return "unix" if local_socket.enabled() else "tcp"


class RefServers:
    """SERVERS processes serving `path` on this host; use as a context manager."""

    def __init__(self, path: str, max_request_bytes: int, servers: int = SERVERS, transport: str | None = None):
        self.path, self.max_request_bytes, self.n = path, max_request_bytes, servers
        self.transport = transport or default_transport()
        if self.transport not in ("unix", "tcp"):
            raise ValueError(f"transport must be 'unix' or 'tcp', not {self.transport!r}")
        self.procs, self.ports = [], []  # ports: TCP ports, or abstract Unix socket names

    def __enter__(self) -> "RefServers":
        ctx = mp.get_context("fork")
        for k in range(self.n):
            if self.transport == "unix":
                listener = socket.socket(socket.AF_UNIX)
                listener.bind(f"\0threefs-refserver/{os.getpid()}/{id(self)}/{k}")
            else:
                listener = socket.socket()
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", 0))
            listener.listen(4)
            p = ctx.Process(target=_serve, args=(self.path, listener, self.max_request_bytes), daemon=True)
            p.start()
            name = listener.getsockname()
            self.ports.append(name if self.transport == "unix" else name[1])
            listener.close()  # the child has its own copy
            self.procs.append(p)
        return self

    def _connect(self, k: int) -> socket.socket:
        if self.transport == "unix":
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(self.ports[k])
            return sock
        sock = socket.create_connection(("127.0.0.1", self.ports[k]))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
            p.join(10)

    def read(self, ios: list[tuple[int, int]], seconds: float | None, batch: int | None = None) -> float:
        """Read `ios` ((offset, length) pairs) over and over for `seconds` (None: once); IOs per second.
        With `batch`, in batches of that many IOs as a batch API reads them: each batch is dealt to the
        servers and the next starts when all of them have answered."""
        if batch:
            return self._read_batches(ios, seconds, batch)
        shares = [ios[i::self.n] for i in range(self.n)]
        done = [0] * self.n
        stop = time.perf_counter() + (seconds or 0)
        errors = []

        def worker(k: int) -> None:
            try:
                sock = self._connect(k)
                mine = shares[k]
                requests = []
                for i in range(0, len(mine), IOS_PER_REQUEST):
                    part = mine[i:i + IOS_PER_REQUEST]
                    requests.append((_HEAD.pack(len(part)) + b"".join(_IO.pack(o, n) for o, n in part),
                                     len(part)))
                buf = memoryview(bytearray(self.max_request_bytes))
                head = memoryview(bytearray(_RSP.size))
                first = True
                while first or time.perf_counter() < stop:
                    first = False
                    for req, count in requests:
                        sock.sendall(req)
                        _recv_exact(sock, head)
                        (n,) = _RSP.unpack(head)
                        _recv_exact(sock, buf[:n])
                        done[k] += count
                sock.close()
            except Exception as e:  # reported by the caller
                errors.append(e)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sum(done) / (time.perf_counter() - t0)


    def _read_batches(self, ios: list[tuple[int, int]], seconds: float | None, batch: int) -> float:
        batches = [ios[i:i + batch] for i in range(0, len(ios), batch)]
        done = [0] * self.n
        stop = time.perf_counter() + (seconds or 0)
        errors: list[BaseException] = []
        barrier = threading.Barrier(self.n)
        go = [True]

        def worker(k: int) -> None:
            try:
                sock = self._connect(k)
                requests = []
                for b in batches:
                    mine = b[k::self.n]
                    requests.append([(_HEAD.pack(len(part)) + b"".join(_IO.pack(o, n) for o, n in part), len(part))
                                     for part in (mine[i:i + IOS_PER_REQUEST] for i in range(0, len(mine), IOS_PER_REQUEST))])
                buf = memoryview(bytearray(self.max_request_bytes))
                head = memoryview(bytearray(_RSP.size))
                while go[0]:
                    for reqs in requests:
                        for req, count in reqs:
                            sock.sendall(req)
                            _recv_exact(sock, head)
                            (n,) = _RSP.unpack(head)
                            _recv_exact(sock, buf[:n])
                            done[k] += count
                        barrier.wait(30)
                    if k == 0:
                        go[0] = time.perf_counter() < stop
                    barrier.wait(30)
                sock.close()
            except Exception as e:  # reported by the caller
                errors.append(e)
                barrier.abort()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sum(done) / (time.perf_counter() - t0)


def random_ios(total: int, size: int, count: int, seed: int = 7) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(0, total // size) * size, size) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=4)
    args = ap.parse_args()
    total = os.path.getsize(args.file)
    with RefServers(args.file, IOS_PER_REQUEST * max(args.size, 1 << 20)) as ref:
        iops = ref.read(random_ios(total, args.size, 4096), args.seconds)
    print(f"reference server ({ref.transport}), random {args.size} B: {iops:,.0f} IO/s "
          f"({iops * args.size / 1e9:.3f} GB/s)")


if __name__ == "__main__":
    main()
