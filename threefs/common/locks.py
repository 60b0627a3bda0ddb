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
