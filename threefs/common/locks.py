"""Locks by key that exist only while someone holds or waits for them (a storage service has one per
chunk being updated; millions of chunks must not leave millions of idle locks behind)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable


class KeyedLocks:
    def __init__(self) -> None:
        self._entries: dict[Hashable, list] = {}  # key -> [lock, holders + waiters]

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


async def outlast(future: asyncio.Future):
    """Await `future`, which stands for work that cannot be stopped (a call running in a thread). If the
    awaiting task is cancelled meanwhile, wait for the work to end first and only then raise the
    CancelledError: whatever the task holds (a chunk lock) stays held while the work still runs. Without
    this, a cancelled request released its chunk lock while its chunk-engine call went on in a disk
    thread, and the next update of that chunk ran beside it."""
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                continue  # cancelled again: the work still runs
            except BaseException:  # the work failed after we were cancelled: the cancellation wins
                break
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: no "exception was never retrieved" at GC
        raise
