"""The meta part of one cache, as plain code: key -> slot, the free list, reservations, LRU and TTL.

No sockets, clocks or disks here: time comes in as arguments and every change that must survive a restart is
appended to `journal` for the caller (the service) to persist in one transaction per request.

A put is two steps, so that a page is visible only once it is completely written and a key's bytes never
mix two writers':

    reserve(keys)  -> each key gets a *fresh* slot nobody else may write (or EXISTS / NO_SPACE)
    ... the client writes the pages to its slots ...
    commit(items)  -> the key -> (slot, length, crc, gen) mapping is published; lookups see it from now on

A reservation that is neither committed nor aborted before its deadline (the client died) frees its slot.
Readers get (slot, length, crc, gen) and verify the crc of what they read; a slot freed by eviction goes to
the back of the free list, so it is reused as late as possible, and a reader that lost that race sees a crc
mismatch (a miss), never wrong bytes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from threefs.common.status import StatusCode, status_error

KEY_BYTES_MAX = 512
BATCH_KEYS_MAX = 4096
RESERVED, EXISTS, NO_SPACE = 0, 1, 2  # reserve() outcomes


class Entry:
    __slots__ = ("slot", "length", "crc", "gen", "atime")

    def __init__(self, slot: int, length: int, crc: int, gen: int, atime: float):
        self.slot, self.length, self.crc, self.gen, self.atime = slot, length, crc, gen, atime


@dataclass
class Reservation:
    key: bytes
    gen: int
    deadline: float  # wall-clock seconds: it survives a restart of the service


@dataclass
class Counters:
    get_hits: int = 0
    get_misses: int = 0
    exists_queries: int = 0
    exists_hits: int = 0
    puts: int = 0  # pages committed
    put_exists: int = 0  # puts skipped: the key was already there
    put_no_space: int = 0
    evictions: int = 0
    expirations: int = 0
    aborted: int = 0  # reservations given back or expired
    corrupt: int = 0  # reads that failed their crc (invalidated)


@dataclass
class CacheIndex:
    cache_id: int
    root: str
    page_bytes: int
    slots: int
    ttl_s: float = 0.0  # 0: no TTL
    evict_batch: int = 0  # slots freed per eviction round (0: 1% of the slots)
    entries: "OrderedDict[bytes, Entry]" = field(default_factory=OrderedDict)  # LRU order: oldest first
    free: deque = field(default_factory=deque)
    hwm: int = 0  # slots >= hwm were never used
    reserved: dict = field(default_factory=dict)  # slot -> Reservation
    next_gen: int = 1
    counters: Counters = field(default_factory=Counters)
    journal: list = field(default_factory=list)  # ("put", key, Entry) | ("del", key) | ("res", slot, R) | ("unres", slot)
    dirty_atime: set = field(default_factory=set)
    used_bytes: int = 0  # sum of the committed pages' lengths

    def __post_init__(self) -> None:
        assert self.slots > 0 and self.page_bytes > 0
        if self.evict_batch <= 0:
            self.evict_batch = max(1, self.slots // 100)

    # -- reads -----------------------------------------------------------------------------------
    def lookup(self, keys: list[bytes], now: float, touch: bool = True, prefix: bool = False,
               count: str = "get") -> list[Entry | None]:
        """The committed entry of each key (None: miss). prefix=True stops at the first miss."""
        check_keys(keys)
        out: list[Entry | None] = []
        for key in keys:
            e = self.entries.get(key)
            if e is not None and self.ttl_s and now - e.atime > self.ttl_s:
                self._drop(key, e)
                self.counters.expirations += 1
                e = None
            if e is not None and touch:
                e.atime = now
                self.entries.move_to_end(key)
                self.dirty_atime.add(key)
            out.append(e)
            if e is None and prefix:
                break
        hits = sum(e is not None for e in out)
        if count == "get":
            self.counters.get_hits += hits
            self.counters.get_misses += len(keys) - hits
        elif count == "exists":
            self.counters.exists_queries += 1
            self.counters.exists_hits += hits
        return out

    # -- writes ----------------------------------------------------------------------------------
    def reserve(self, keys: list[bytes], lengths: list[int], now: float, lease_s: float) -> list[tuple[int, int, int]]:
        """(outcome, slot, gen) per key: a fresh slot for keys not yet present."""
        check_keys(keys)
        if len(lengths) != len(keys):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(lengths)} lengths")
        for n in lengths:
            if not 0 < n <= self.page_bytes:
                raise status_error(StatusCode.INVALID_ARGUMENT,
                                   f"page of {n} bytes: pages of this cache hold 1..{self.page_bytes} bytes")
        wanted = [k for k in dict.fromkeys(keys) if k not in self.entries]
        self._make_room(len(wanted))
        out = []
        given: dict[bytes, tuple[int, int, int]] = {}
        for key in keys:
            if key in self.entries:
                self.counters.put_exists += 1
                out.append((EXISTS, -1, 0))
                continue
            if key in given:  # the same key twice in one batch: the first one writes it
                out.append((EXISTS, -1, 0))
                continue
            slot = self._take_slot()
            if slot < 0:
                self.counters.put_no_space += 1
                out.append((NO_SPACE, -1, 0))
                continue
            gen = self.next_gen
            self.next_gen += 1
            r = self.reserved[slot] = Reservation(key, gen, now + lease_s)
            self.journal.append(("res", slot, r))
            given[key] = (RESERVED, slot, gen)
            out.append(given[key])
        return out

    def commit(self, items: list[tuple[bytes, int, int, int, int]], now: float) -> list[bool]:
        """Publish (key, slot, gen, length, crc) of written pages. False: the reservation is gone (it
        expired) or another writer's commit of the key came first; that slot is then freed."""
        out = []
        for key, slot, gen, length, crc in items:
            r = self.reserved.get(slot)
            if r is None or r.gen != gen or r.key != key:
                e = self.entries.get(key)  # a retried commit (the answer to the first one was lost)
                out.append(e is not None and e.slot == slot and e.gen == gen)
                continue
            self._unreserve(slot)
            if key in self.entries:  # committed by someone else meanwhile: keep theirs
                self._free_slot(slot)
                out.append(False)
                continue
            if not 0 < length <= self.page_bytes:
                self._free_slot(slot)
                raise status_error(StatusCode.INVALID_ARGUMENT, f"committed length {length} out of range")
            e = self.entries[key] = Entry(slot, length, crc & 0xFFFFFFFF, gen, now)
            self.used_bytes += length
            self.journal.append(("put", key, e))
            self.counters.puts += 1
            out.append(True)
        return out

    def abort(self, slots: list[tuple[int, int]]) -> int:
        """Give back reserved (slot, gen) pairs whose write failed."""
        n = 0
        for slot, gen in slots:
            r = self.reserved.get(slot)
            if r is not None and r.gen == gen:
                self._unreserve(slot)
                self._free_slot(slot)
                self.counters.aborted += 1
                n += 1
        return n

    def remove(self, keys: list[bytes]) -> int:
        check_keys(keys)
        n = 0
        for key in keys:
            e = self.entries.get(key)
            if e is not None:
                self._drop(key, e)
                n += 1
        return n

    def invalidate(self, items: list[tuple[bytes, int]]) -> int:
        """Drop entries whose page failed its checksum on read (only the generation that was read)."""
        n = 0
        for key, gen in items:
            e = self.entries.get(key)
            if e is not None and e.gen == gen:
                self._drop(key, e)
                self.counters.corrupt += 1
                n += 1
        return n

    def clear(self) -> int:
        n = len(self.entries)
        for key, e in list(self.entries.items()):
            self._drop(key, e)
        return n

    # -- background ------------------------------------------------------------------------------
    def sweep(self, now: float, limit: int = 10_000) -> tuple[int, int]:
        """Free expired reservations and (with a TTL) entries idle longer than ttl_s; bounded work per call.
        Returns (reservations expired, entries expired)."""
        dead = [slot for slot, r in self.reserved.items() if r.deadline < now][:limit]
        for slot in dead:
            self._unreserve(slot)
            self._free_slot(slot)
            self.counters.aborted += 1
        expired = 0
        if self.ttl_s:
            while self.entries and expired < limit:
                key, e = next(iter(self.entries.items()))
                if now - e.atime <= self.ttl_s:
                    break
                self._drop(key, e)
                expired += 1
            self.counters.expirations += expired
        return len(dead), expired

    def stats(self) -> dict:
        c = self.counters
        lookups = c.get_hits + c.get_misses
        return {"root": self.root, "cache_id": self.cache_id, "page_bytes": self.page_bytes,
                "capacity_bytes": self.slots * self.page_bytes, "slots": self.slots,
                "pages": len(self.entries), "used_bytes": self.used_bytes,
                "reserved": len(self.reserved), "ttl_s": self.ttl_s,
                "hit_rate": c.get_hits / lookups if lookups else 0.0, **c.__dict__}

    # -- internals -------------------------------------------------------------------------------
    def _take_slot(self) -> int:
        if self.free:
            return self.free.popleft()
        if self.hwm < self.slots:
            self.hwm += 1
            return self.hwm - 1
        return -1

    def _free_slot(self, slot: int) -> None:
        assert 0 <= slot < self.hwm and slot not in self.reserved
        self.free.append(slot)  # the back: reused as late as possible (readers may still be on it)

    def _unreserve(self, slot: int) -> None:
        del self.reserved[slot]
        self.journal.append(("unres", slot))

    def _drop(self, key: bytes, e: Entry) -> None:
        del self.entries[key]
        self.used_bytes -= e.length
        self.dirty_atime.discard(key)
        self.journal.append(("del", key))
        self._free_slot(e.slot)

    def _make_room(self, n: int) -> None:
        """Evict least recently used entries, a batch at a time, until n slots can be taken."""
        available = len(self.free) + (self.slots - self.hwm)
        if available >= n:
            return
        target = min(len(self.entries), max(n - available, self.evict_batch))
        for _ in range(target):
            key, e = next(iter(self.entries.items()))
            self._drop(key, e)
        self.counters.evictions += target


def check_keys(keys: list[bytes]) -> None:
    if len(keys) > BATCH_KEYS_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"batch of {len(keys)} keys exceeds {BATCH_KEYS_MAX}; "
                           "split it")
    for k in keys:
        if not isinstance(k, bytes) or not 0 < len(k) <= KEY_BYTES_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"a key is 1..{KEY_BYTES_MAX} bytes, not {type(k).__name__} of "
                               f"{len(k) if isinstance(k, (bytes, str)) else '?'}")
