"""Running a coroutine by hand up to its first wait (what Python 3.12's eager tasks do for Tasks).

Most metadata calls never wait: an RPC handler (rpc/server.py) or a KV transaction (kv/api.py) that runs
to completion in one step needs no Task, no loop iteration and no deadline timer. The caller steps the
coroutine once; only if it suspends does the caller arm what a waiting coroutine needs (a Task, a deadline)
and go on with `Resumed`, which hands the coroutine's first yield to the event loop and then delegates.

    coro = work()
    try:
        first = coro.send(None)
    except StopIteration as done:
        result = done.value                      # finished without waiting
    else:
        async with asyncio.timeout_at(deadline):
            result = await Resumed(coro, first)  # waited: bounded from here on, as before
"""

from __future__ import annotations


class Resumed:
    """A coroutine that was run by hand up to its first suspension, to be resumed by whoever awaits (or a
    Task that runs) this: it first yields what the coroutine yielded, then delegates to it."""

    __slots__ = ("_coro", "_first", "_fresh")

    def __init__(self, coro, first) -> None:
        self._coro = coro
        self._first = first
        self._fresh = True

    def send(self, value):
        if self._fresh:
            self._fresh = False
            return self._first
        return self._coro.send(value)

    def throw(self, *exc):
        self._fresh = False
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __next__(self):
        return self.send(None)

    def __iter__(self):
        return self

    def __await__(self):
        return self
