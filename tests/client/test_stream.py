"""The streaming engine (client/stream.py) on its own, over the real async client: every way File objects
and the FUSE daemon read (FUSE-style concurrent requests, reads into the caller's memory, lent segments
and advancing past them)
returns the file's bytes; a buffer storage may still write into is never handed out again; every buffer
comes back; overlapping writes land in order; a background write's error surfaces at the next call and
only acknowledged bytes count."""

from __future__ import annotations

import asyncio
import collections
import random
import time

import msgspec
import numpy as np
import pytest

from threefs.client.stream import ReadAhead, WriteBehind, segment_bytes
from threefs.common.buffers import BufferPool
from threefs.common.status import StatusCode, ThreeFSError

CS = 1 << 20


def address(view) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class WatchedReads:
    """The real async client, counting the reads that are writing into each buffer right now."""

    def __init__(self, aio):
        self.aio = aio
        self.writing = collections.Counter()

    async def read_into(self, attr, offset, dest):
        key = address(dest)
        self.writing[key] += 1
        try:
            return await self.aio.read_into(attr, offset, dest)
        finally:
            self.writing[key] -= 1


class WatchedPool(BufferPool):
    """A real BufferPool that notes a buffer lent twice, or given back while a read still writes into it."""

    def __init__(self, writing: collections.Counter):
        super().__init__(bytes_max=8 * CS)
        self.writing = writing
        self.lent: set[int] = set()
        self.violations: list[str] = []

    def acquire(self, nbytes: int):
        lease = super().acquire(nbytes)
        key = address(lease.view)
        if key in self.lent:
            self.violations.append(f"buffer {key:#x} lent while already lent")
        self.lent.add(key)
        return lease

    def _give_back(self, buf) -> None:
        key = address(buf)
        if self.writing[key]:
            self.violations.append(f"buffer {key:#x} given back while a read writes into it")
        self.lent.discard(key)
        super()._give_back(buf)


async def _read_script(aio, attr, data: bytes, seed: int, slack: int | None) -> WatchedPool:
    rng = random.Random(seed)
    watched = WatchedReads(aio)
    pool = WatchedPool(watched.writing)
    seg = segment_bytes(attr.layout.chunk_size)
    ra = ReadAhead(watched, pool, seg, 4 * seg, reader=watched, slack_bytes=slack)
    held, pos, length = [], 0, attr.length
    for _ in range(300):
        op = rng.choice(["seq", "seq", "seq", "jump", "fuse", "into", "hold", "release", "drop"])
        if op == "jump":
            pos = rng.randrange(0, length)
        elif op == "drop":
            ra.drop()
        elif op == "release" and held:
            ra.release(held.pop(rng.randrange(len(held))))
        elif op == "hold":
            h = await ra.hold(attr, pos, rng.randrange(1, 3 * seg))
            assert h is not None and h.covers(pos) and bytes(h.view) == data[h.offset:h.end]
            held.append(h)
        elif op == "into":
            dest = bytearray(rng.choice([rng.randrange(1, 200_000), rng.randrange(seg, 3 * seg)]))
            got, lent = await ra.read_into(attr, pos, memoryview(dest), hold=rng.random() < 0.5)
            assert dest[:got] == data[pos:pos + got] and got == min(len(dest), length - pos)
            if lent:  # what follows the read, contiguous, as the file has it
                assert lent[0].covers(pos + got) and all(a.end == b.offset for a, b in zip(lent, lent[1:]))
                if rng.random() < 0.5:  # the borrower reads on past the first: more are lent behind it
                    lent = lent[1:] + ra.advance(attr, lent[0].end, lent[:1])
                    assert all(a.end == b.offset for a, b in zip(lent, lent[1:]))
                for h in lent:
                    await h.ready()  # lent while being read: the bytes are there once it is over
                    assert bytes(h.view) == data[h.offset:h.end]
                held += lent
            pos = min(length - 1, pos + got)
        else:  # FUSE: a few requests of one stream at once, in any order
            size = rng.choice([4096, 128 << 10, CS])
            offs = [o for o in range(pos, min(length, pos + rng.randrange(1, 5) * size), size)]
            later, order = [], rng.sample(offs, len(offs))
            replies = await asyncio.gather(*(ra.read(attr, o, min(size, length - o), later.append)
                                             for o in order))
            for o, r in zip(order, replies):
                assert bytes(r) == data[o:o + min(size, length - o)]
            for fn in later:  # the replies are sent: their buffers may go back
                fn()
            pos = min(length - 1, offs[-1] + size)
    for h in held:
        ra.release(h)
    ra.drop()
    deadline = time.monotonic() + 30
    while pool.lent and time.monotonic() < deadline:  # cancelled reads give their buffers back when over
        await asyncio.sleep(0.01)
    return pool


@pytest.mark.parametrize("slack", [0, None], ids=["file", "fuse"])
def test_read_ahead_returns_the_files_bytes_and_never_reuses_a_buffer_in_use(fs, d, slack):
    data = random.Random(5).randbytes(7 * CS + 12345)
    fs.write_bytes(f"{d}/ra-{slack}", data)
    attr = fs.stat(f"{d}/ra-{slack}")
    pool = fs.run(_read_script(fs.aio, attr, data, seed=11, slack=slack))
    assert not pool.violations, pool.violations[:5]
    assert not pool.lent, f"{len(pool.lent)} buffers never came back"


async def _write_script(aio, attr, seed: int) -> tuple[bytes, WriteBehind]:
    rng = random.Random(seed)
    seg = segment_bytes(attr.layout.chunk_size)
    w = WriteBehind(aio, attr, seg, 2 * seg)  # little room in flight: writes wait for each other
    model = bytearray()
    for _ in range(120):
        off = rng.choice([len(model), rng.randrange(0, 3 * seg)])
        piece = rng.randbytes(rng.choice([rng.randrange(1, 5000), rng.randrange(1, 2 * seg + 7)]))
        if rng.random() < 0.5:  # File's way: stage what fits, the rest through write()
            mutable = bytearray(piece)
            taken = w.stage(off, memoryview(mutable))
            await w.write(off + taken, memoryview(mutable)[taken:], immutable=False)
            mutable[:] = bytes(len(mutable))  # the caller reuses its buffer at once
        else:
            await w.write(off, piece)
        model.extend(bytes(max(0, off + len(piece) - len(model))))
        model[off:off + len(piece)] = piece
        if rng.random() < 0.1:
            await w.flush()
    await w.flush()
    return bytes(model), w


def test_write_behind_keeps_the_order_of_overlapping_writes(fs, d):
    with fs.open(f"{d}/wb", "wb"):
        pass
    attr = fs.stat(f"{d}/wb")
    model, w = fs.run(_write_script(fs.aio, attr, seed=3))
    assert w.acked_end == len(model) and not w.failed and not w.dirty
    buf = bytearray(len(model))  # the engine publishes no length (its users do): read with ours
    assert fs.run(fs.aio.read_into(msgspec.structs.replace(attr, length=len(model)), 0, buf)) == len(model)
    assert bytes(buf) == model


async def _failing_writes(aio, attr):
    w = WriteBehind(aio, attr, segment_bytes(attr.layout.chunk_size), 8 * CS)
    await w.write(0, b"ok" * 10)
    await w.flush()
    far = CS * (1 << 32)  # chunk index 2**32: not addressable, fails in the background
    await w.write(far, b"lost")
    await w.write(far + 4, b"also lost")  # still buffered: returns at once
    errors = []
    for step in (w.flush, lambda: w.write(40, b"x")):
        try:
            await step()
        except ThreeFSError as e:
            errors.append(e.code)
    await w.flush()  # the error was raised once; the writer goes on
    return errors, w, far + 13


def test_write_behind_error_surfaces_once_and_only_acknowledged_bytes_count(fs, d):
    with fs.open(f"{d}/wf", "wb"):
        pass
    errors, w, written_end = fs.run(_failing_writes(fs.aio, fs.stat(f"{d}/wf")))
    assert errors == [StatusCode.FILE_TOO_LARGE]
    assert w.failed and w.acknowledged(written_end) == 41  # "ok" * 10, then b"x" at 40
