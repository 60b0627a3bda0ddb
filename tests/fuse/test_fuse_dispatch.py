"""How the FUSE daemon waits for the kernel's requests (client/fuse_mount.py _fast_wait_readable): /dev/fuse
stays registered with the event loop while pyfuse3's workers take requests one after another (no epoll
change per request); when it is readable and no worker waits for two loop turns in a row (every worker
busy), it is unregistered, so the loop does not spin on a level-triggered descriptor, and the next waiter
registers it again; the session closing (pyfuse3.terminate -> notify_closing) or a cancelled worker leaves
nothing registered and nothing in pyfuse3's list of waiting futures.

Real parts: a real event loop (asyncio's selector loop, counting its reader registrations; and uvloop, the
daemon's, for the same flow) and a pipe standing for /dev/fuse: a byte in it is a queued request."""

from __future__ import annotations

import asyncio
import collections
import os
import types

import pytest
import uvloop

from threefs.client import fuse_mount


class CountingLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        super().__init__()
        self.added = self.removed = 0

    def add_reader(self, fd, callback, *args):
        self.added += 1
        return super().add_reader(fd, callback, *args)

    def remove_reader(self, fd):
        self.removed += 1
        return super().remove_reader(fd)


def _pyfuse3_asyncio():
    """What _fast_wait_readable replaces and uses of pyfuse3.asyncio: wait_readable, _read_futures."""
    fake = types.SimpleNamespace(_read_futures=collections.defaultdict(set), wait_readable=None)
    fuse_mount._fast_wait_readable(fake)
    return fake


def _notify_closing(fake, fd):  # pyfuse3.asyncio.notify_closing, as pyfuse3.terminate calls it
    for f in fake._read_futures[fd]:
        f.set_exception(RuntimeError("closing"))


async def _requests(fake, r, w, n):
    """n requests, one after another, taken by a worker as pyfuse3's are: wait until readable, then read in
    the same step (fuse_session_receive_buf)."""
    taken = asyncio.Queue()

    async def worker():
        for _ in range(n):
            await fake.wait_readable(r)
            await taken.put(os.read(r, 1))

    task = asyncio.ensure_future(worker())
    for i in range(n):
        os.write(w, bytes([i]))
        assert await asyncio.wait_for(taken.get(), 5) == bytes([i])
    await task


def test_requests_one_after_another_cost_no_epoll_change():
    loop = CountingLoop()
    r, w = os.pipe()
    fake = _pyfuse3_asyncio()
    try:
        loop.run_until_complete(_requests(fake, r, w, 50))
        assert (loop.added, loop.removed) == (1, 0)
        assert not fake._read_futures  # no future left behind
    finally:
        fuse_mount._stop_watching()
        loop.close()
        os.close(r)
        os.close(w)
    assert not fuse_mount._WATCHES


def test_busy_workers_unregister_then_the_next_waiter_registers_again():
    async def scenario(loop, fake, r, w):
        await _requests(fake, r, w, 1)
        watch = fuse_mount._WATCHES[r]
        os.write(w, b"q")  # a request queued while no worker waits (all busy)
        for _ in range(fuse_mount.IDLE_FIRES_MAX - 1):
            await asyncio.sleep(0)
        assert watch.registered  # a woken worker reads a turn later: not yet "all busy"
        for _ in range(2):
            await asyncio.sleep(0)
        assert not watch.registered and loop.removed == 1  # unregistered: the loop does not spin on it
        got = await asyncio.wait_for(fake.wait_readable(r), 5)  # a worker free again: registers, wakes
        assert got is None and watch.registered and loop.added == 2
        assert os.read(r, 1) == b"q"

    loop = CountingLoop()
    r, w = os.pipe()
    fake = _pyfuse3_asyncio()
    try:
        loop.run_until_complete(scenario(loop, fake, r, w))
    finally:
        fuse_mount._stop_watching()
        loop.close()
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("ending", ["terminate", "cancel"])
def test_closing_or_cancelling_the_waiter_leaves_nothing_registered(ending):
    async def scenario(fake, r):
        waiting = asyncio.ensure_future(fake.wait_readable(r))
        await asyncio.sleep(0)
        watch = fuse_mount._WATCHES[r]
        assert watch.registered and len(fake._read_futures[r]) == 1
        if ending == "terminate":
            _notify_closing(fake, r)
            with pytest.raises(RuntimeError, match="closing"):
                await waiting
        else:
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        assert not watch.registered and r not in fake._read_futures

    r, w = os.pipe()
    fake = _pyfuse3_asyncio()
    loop = uvloop.new_event_loop()  # the daemon's loop
    try:
        loop.run_until_complete(_requests(fake, r, w, 20))
        loop.run_until_complete(scenario(fake, r))
    finally:
        fuse_mount._stop_watching()
        loop.close()
        os.close(r)
        os.close(w)
