"""Read-around for small buffered reads through the mount: the pages around a random read miss go into
the kernel's page cache (FUSE_NOTIFY_STORE), so that later reads of them never reach the daemon.

A small random read of a file opened without O_DIRECT that misses the page cache reaches the daemon as
one request of the pages asked for (the kernel reads random misses "as is": no read-ahead). The daemon
then reads the aligned window around it (`MountOptions.read_around_bytes`, 64 KiB by default; the whole
aligned `read_around_region_bytes`, 1 MiB, at a second miss in the same region of the file) in the same
one storage request, answers the request from it and, once the reply is in, hands the window to the
kernel's page cache. Re-reads of a file that fits in memory (a dataset read at random for epochs, a
table's index blocks) then become page cache hits in the reader's own process. Files longer than a
quarter of the machine's memory get no read-around (their pages would mostly be evicted before a re-read),
and `--read-around-kb 0` turns it off.

Gain and cost, measured by benchmarks/fuse_read_around.py (the same cluster mounted with and without it,
docs/fuse.md "Read-around"): random 4 KiB re-reads of a 128 MiB file ~12x the reads/s; a workload that
never re-reads (every read the first of its window) 0.83x, the daemon spending ~80-130 us more CPU per
miss, mostly the store thread's wake-up and GIL hand-offs. A 128 KiB window would cost far more per miss:
storage reads of 128 KiB and more take the client's batch path (cluster/storage_client.py
SOLO_IO_BYTES_MIN), not its one-item path.

The store runs in a thread of its own, never in the event loop: the kernel writes a stored page under
its page lock, and a page of the window may be locked by another read request that this daemon has not
answered yet (queued in the kernel or in flight here), which the loop must stay free to answer.

Consistency (ThreeFSOperations._read_around, _store_window, _changing_pages): data is stored only when no
handle of this daemon has the file open for writing (so no page can hold a newer write than the storage
read) and when nothing moved the file's *epoch* since the storage read began: an open at which the
kernel may drop the file's pages (meta's stamp of the file differs from the one its pages are of) or
that is for writing, every write, truncate and hole punch, and every change of the length the kernel was
told. Those opens, truncates and fallocate wait for the stores already handed to the thread to finish
before they answer the kernel, so that a page stored from an older epoch is in the cache before the
kernel drops or keeps pages at that open, never after. A read-only open of a file as its pages are
neither moves the epoch nor waits: what is being stored is still the file's. The stored
range never reaches past the length the kernel was last told (a store past it would extend the kernel's
size); and a store during which the epoch moved (a getattr may just have told the kernel a smaller size,
which such a store would undo) invalidates the kernel's attributes of the file once it is in, so the
kernel asks for them again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading

import pyfuse3

log = logging.getLogger(__name__)

QUEUED_MAX = 256  # stores waiting for the thread at most (their buffers are held); more are not stored
QUEUED_BYTES_MAX = 64 << 20  # ... and the bytes they hold at most (a region store is 1 MiB)


class PageStore:
    """A thread that stores pages in the kernel's page cache; per-inode counts of stores not yet done."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: collections.Counter = collections.Counter()  # fuse ino -> stores not done
        self._waiters: dict[int, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._finished: list = []  # leases of finished stores, released by the loop (BufferPool is not
        # thread-safe)
        self._thread: threading.Thread | None = None
        self.queued = 0  # stores handed over and not done (read without the lock: a hint)
        self.queued_bytes = 0  # the bytes they hold (likewise)
        self.stats = collections.Counter()  # read by the loop thread: approximate, logged at unmount

    def submit(self, ino: int, pieces: list[tuple[int, memoryview]], lease, moved=None) -> None:
        """Store `pieces` ((file offset, data) of ino) in the page cache; `lease` (the buffer they are
        views of) is released by the loop (`reclaim`) once they are stored. `moved()`, called in the store
        thread once they are stored: whether the file changed meanwhile (its epoch moved); then the
        kernel's attributes of the inode are invalidated, because a store that reaches past the kernel's
        size extends it (and makes the kernel ignore replies to requests sent before it), and the size
        may have just been lowered (a truncate another client made, learnt by a getattr)."""
        nbytes = sum(len(data) for _, data in pieces)
        with self._lock:
            self._pending[ino] += 1
            self.queued += 1
            self.queued_bytes += nbytes
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fuse-page-store", daemon=True)
            self._thread.start()
        self._queue.put((ino, pieces, lease, moved, nbytes))

    def full(self) -> bool:
        return self.queued >= QUEUED_MAX or self.queued_bytes >= QUEUED_BYTES_MAX

    def busy(self, ino: int) -> bool:
        with self._lock:
            return self._pending[ino] > 0

    async def settle(self, ino: int) -> None:
        """Return once every store of ino handed over so far is done."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._pending[ino]:
                return
            fut = loop.create_future()
            self._waiters.setdefault(ino, []).append((loop, fut))
        self.stats["settle_waits"] += 1
        await fut

    def reclaim(self) -> None:
        """Release the buffers of finished stores (the loop's thread only)."""
        if self._finished:
            with self._lock:
                done, self._finished = self._finished, []
            for lease in done:
                lease.release()

    def _run(self) -> None:
        while True:
            ino, pieces, lease, moved, nbytes = self._queue.get()
            stored = 0
            for offset, data in pieces:
                try:
                    pyfuse3.notify_store(ino, offset, data)
                    stored += len(data)
                except OSError as e:  # ENOENT: the kernel forgot the inode; ENODEV: unmounted
                    log.debug("storing %d bytes of inode %d at %d in the page cache: %s", len(data), ino,
                              offset, e)
                    self.stats["store_errors"] += 1
                    break
                except Exception:  # never let the thread die: the loop's settle() would wait forever
                    log.exception("storing pages of inode %d", ino)
                    self.stats["store_errors"] += 1
                    break
            self.stats["stored_bytes"] += stored
            try:
                if stored and moved is not None and moved():
                    pyfuse3.invalidate_inode(ino, attr_only=True)
                    self.stats["attr_invalidations"] += 1
            except OSError as e:  # ENOENT: the kernel forgot the inode
                log.debug("invalidating the attributes of inode %d: %s", ino, e)
            except Exception:  # (as above: the thread must go on)
                log.exception("invalidating the attributes of inode %d", ino)
            with self._lock:
                self._finished.append(lease)
                self.queued -= 1
                self.queued_bytes -= nbytes
                self._pending[ino] -= 1
                if self._pending[ino] <= 0:
                    del self._pending[ino]
                    waiters = self._waiters.pop(ino, ())
                else:
                    waiters = ()
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_resolve, fut)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


__all__ = ["PageStore"]
