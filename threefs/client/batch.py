"""Batch IO: many (file, offset, buffer) reads or writes with all their chunk IOs in flight together.

    results = fs.batch_read([(path, 0, buf_a), (attr, 1 << 20, 4096, buf_b), (f, 0, arr)])
    results = fs.batch_write([(path, 0, data_a), (path, 8192, data_b)])

An item is `(file, offset, buffer)` or `(file, offset, length, buffer)`; `file` is a path, an
InodeAttr or an open threefs file object; `buffer` is any contiguous buffer (bytearray, memoryview,
numpy array; a torch tensor through `.numpy()`). Reads land straight in the buffers. A result per
item: bytes done, or the exception of that item (`raise_on_error=False`).

The IOs of one batch are grouped per storage service; the storage client bounds the requests in
flight per service. Writes publish the new file lengths to meta once the batch is on storage.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import NamedTuple

from threefs.common import limits
from threefs.common.ids import chunk_id
from threefs.common.layout import chain_of_chunk, split_range
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import as_bytes_view
from threefs.rpc.schemas import meta as m


@dataclass
class WriteTarget:
    """Where a batch item's file comes from, so its length can be published after the writes."""

    attr: m.InodeAttr
    session: str = ""  # a session this batch opened itself (closed after the writes)
    file: object = None  # an open file object (its own length bookkeeping is updated)
    end: int = -1  # highest end successfully written by this batch


def item_parts(item) -> tuple[object, int, memoryview]:
    """(file, offset, buffer) or (file, offset, length, buffer) -> (file, offset, view)."""
    if len(item) == 3:
        file, offset, buf = item
        view = as_bytes_view(buf)
    elif len(item) == 4:
        file, offset, length, buf = item
        view = as_bytes_view(buf)
        if length < 0 or length > len(view):
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"item length {length} does not fit its buffer of {len(view)} bytes")
        view = view[:length]
    else:
        raise status_error(StatusCode.INVALID_ARGUMENT, "a batch item is (file, offset, buffer) or "
                           f"(file, offset, length, buffer), not a {len(item)}-tuple")
    if not isinstance(offset, int) or offset < 0:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"item offset {offset!r} must be an int >= 0")
    return file, offset, view


def check_batch_size(n: int) -> None:
    if n > limits.BATCH_IOS_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT,
                           f"batch of {n} IOs exceeds {limits.BATCH_IOS_MAX}; split it")


def check_no_overlap(requests: list[tuple[m.InodeAttr, int, memoryview]]) -> None:
    """Writes of one batch run in any order, so two of them must not touch the same bytes."""
    spans = sorted((attr.inode, off, off + len(view), i) for i, (attr, off, view) in enumerate(requests)
                   if len(view))
    for (ino_a, _, end_a, i), (ino_b, begin_b, _, j) in zip(spans, spans[1:]):
        if ino_a == ino_b and begin_b < end_a:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"batch_write items {i} and {j} overlap in "
                               f"inode {ino_a} at byte {begin_b}; their order would be undefined")


class _Piece(NamedTuple):
    inode: int
    chunk_index: int
    chunk_offset: int
    data: memoryview
    item: int


def _runs(pieces: list[_Piece]) -> list[list[_Piece]]:
    """Pieces of one chunk that touch end to end become one run: one storage update instead of many
    (each update of a chunk is serialised on its chunk lock and replicated down the chain)."""
    pieces.sort(key=lambda p: (p.inode, p.chunk_index, p.chunk_offset))
    runs: list[list[_Piece]] = []
    for p in pieces:
        last = runs[-1][-1] if runs else None
        if (last is not None and (last.inode, last.chunk_index) == (p.inode, p.chunk_index)
                and last.chunk_offset + len(last.data) == p.chunk_offset):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


async def write_batch(aio, requests: list[tuple[m.InodeAttr, int, memoryview]]) -> list[int | ThreeFSError]:
    """Write every (attr, offset, data) item; all chunk updates in flight together, adjacent pieces of
    one chunk merged. Does not touch meta: the caller publishes lengths (see Client.batch_write).
    A result (bytes or error) per item."""
    check_batch_size(len(requests))
    check_no_overlap(requests)
    routing = await aio.mgmtd.get()
    attrs = {attr.inode: attr for attr, _, _ in requests}
    pieces = [_Piece(attr.inode, s.chunk_index, s.chunk_offset,
                     data[s.buffer_offset:s.buffer_offset + s.length], i)
              for i, (attr, offset, data) in enumerate(requests)
              for s in split_range(attr.layout.chunk_size, offset, len(data))]
    errors: dict[int, ThreeFSError] = {}

    async def write_run(run: list[_Piece]) -> None:
        first = run[0]
        layout = attrs[first.inode].layout
        data = first.data if len(run) == 1 else b"".join(p.data for p in run)
        try:
            table = routing.table(layout.table_id).chains
            await aio.storage.write_chunk(chain_of_chunk(layout, first.chunk_index, table),
                                          chunk_id(first.inode, first.chunk_index), first.chunk_offset,
                                          data, layout.chunk_size)
        except ThreeFSError as e:
            for p in run:
                errors.setdefault(p.item, e)

    await asyncio.gather(*(write_run(run) for run in _runs(pieces)))
    return [errors.get(i, len(data)) for i, (_, _, data) in enumerate(requests)]


def _attr_of(client, file, cache: dict[str, m.InodeAttr | ThreeFSError]) -> m.InodeAttr | ThreeFSError:
    """The attr a read item names; a path that cannot be stat-ed gives its error (per item)."""
    from threefs.client.file import File

    if isinstance(file, m.InodeAttr):
        attr = file
    elif hasattr(file, "_attr_now"):
        if isinstance(file, File):
            file.flush()  # the batch must see the file object's buffered writes
        attr = file._attr_now()
    else:
        path = os.fspath(file)
        if path not in cache:
            try:
                cache[path] = client.stat(path)
            except ThreeFSError as e:
                cache[path] = e
        attr = cache[path]
    if isinstance(attr, m.InodeAttr) and (attr.type != m.FILE or attr.layout is None):
        return status_error(StatusCode.IS_DIRECTORY if attr.type == m.DIRECTORY else StatusCode.INVALID_ARGUMENT,
                            f"inode {attr.inode} is not a regular file")
    return attr


def resolve_read_items(client, items) -> list[tuple[m.InodeAttr, int, memoryview] | ThreeFSError]:
    """User items -> (attr, offset, writable view), or the item's error (missing file, directory).
    Malformed items (bad tuple, read-only buffer) raise: they are the caller's bug.

    The common item, (InodeAttr, int, memoryview of bytes), costs a few type checks here (this loop runs
    once per item of every batch; the rest of the read path works on arrays)."""
    from threefs.client.file import check_buffer_writable

    cache: dict[str, m.InodeAttr | ThreeFSError] = {}
    checked: dict[int, m.InodeAttr | ThreeFSError] = {}  # id(InodeAttr) -> itself or its error
    out = []
    append = out.append
    InodeAttr, MemoryView = m.InodeAttr, memoryview
    for item in items:
        if (type(item) is tuple and len(item) == 3 and type(item[2]) is MemoryView
                and type(item[1]) is int and item[1] >= 0):
            file, offset, view = item
            if view.format != "B" or view.ndim != 1 or view.readonly:
                view = check_buffer_writable(view)
        else:
            file, offset, view = item_parts(item)
            view = check_buffer_writable(view)
        if type(file) is InodeAttr:
            attr = checked.get(id(file))
            if attr is None:
                attr = checked[id(file)] = _attr_of(client, file, cache)
        else:
            attr = _attr_of(client, file, cache)
        append(attr if isinstance(attr, ThreeFSError) else (attr, offset, view))
    return out


def _write_target(client, file, by_path: dict, targets: dict, create: bool) -> WriteTarget | ThreeFSError:
    from threefs.client.aio import open_flags

    if isinstance(file, m.InodeAttr):
        if file.type != m.FILE or file.layout is None:
            return status_error(StatusCode.IS_DIRECTORY, f"inode {file.inode} is not a regular file")
        return targets.setdefault(file.inode, WriteTarget(file))
    if hasattr(file, "_attr_now"):
        if not file.writable():
            raise status_error(StatusCode.BAD_FILE_HANDLE, f"{file.name} is not open for writing")
        if hasattr(file, "flush"):
            file.flush()  # earlier buffered writes of the object go first
        return targets.setdefault(file.attr.inode, WriteTarget(file.attr, file=file))
    path = os.fspath(file)
    if path not in by_path:
        try:
            flags = open_flags("r+b")[0] | (os.O_CREAT if create else 0)
            rsp = client.run(client.aio.open(path, flags))
            if rsp.attr.type != m.FILE:
                raise status_error(StatusCode.IS_DIRECTORY, f"{path} is not a regular file")
            by_path[path] = targets[rsp.attr.inode] = WriteTarget(rsp.attr, session=rsp.session)
        except ThreeFSError as e:
            by_path[path] = e
    return by_path[path]


def open_write_targets(client, items, create: bool) -> tuple[list, dict[int, WriteTarget]]:
    """Resolve write items to (attr, offset, view) or the item's error, and the files whose lengths
    must be published afterwards (paths are opened for writing once each)."""
    targets: dict[int, WriteTarget] = {}
    by_path: dict[str, WriteTarget | ThreeFSError] = {}
    out = []
    try:
        for item in items:
            file, offset, view = item_parts(item)
            target = _write_target(client, file, by_path, targets, create)
            out.append(target if isinstance(target, ThreeFSError) else (target.attr, offset, view))
    except BaseException:
        close_write_targets(client, targets)
        raise
    return out, targets


def close_write_targets(client, targets: dict[int, WriteTarget]) -> None:
    """Publish each file's new length (and end the sessions this batch opened)."""
    errors = []
    for t in targets.values():
        try:
            if t.file is not None:
                t.file._written_end = max(t.file._written_end, t.end)
            elif t.session:
                client.run(client.aio.close_file(t.attr.inode, t.session, t.end))
            elif t.end >= 0:  # an InodeAttr item: no session, the hint carries its truncate version
                client.run(client.aio.sync_file(t.attr.inode, "", t.end, t.attr.truncate_ver))
        except ThreeFSError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def run_partial(resolved: list, run) -> list:
    """Run `run(valid requests)` (a list of results) on the items that resolved; failed items keep their
    error."""
    if not any(isinstance(r, ThreeFSError) for r in resolved):
        return run(resolved) if resolved else []
    valid = [i for i, r in enumerate(resolved) if not isinstance(r, ThreeFSError)]
    results = list(resolved)
    if valid:
        for i, r in zip(valid, run([resolved[i] for i in valid])):
            results[i] = r
    return results


class ReadCoalescer:
    """Reads started in the same event-loop turn go to storage as one batch (one request per storage
    service for the small ones), so many concurrent small reads (FUSE requests) share round trips.

    Callers must not reuse a destination buffer if their read was cancelled: the batch it joined may
    still fill it."""

    def __init__(self, aio):
        self._aio = aio
        self._pending: list[tuple[list, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()  # batches in flight: owned here (the loop keeps only weak refs)
        self.batches = 0  # storage calls made, and reads they carried (for the daemon's statistics)
        self.reads = 0

    async def read_into(self, attr: m.InodeAttr, offset: int, dest: memoryview, alone: bool = False) -> int:
        """Like AsyncClient.read_into: up to len(dest) bytes at offset, clamped to the file length.
        `alone`: the caller knows no other read will join this one (FUSE's gate: nothing else in flight or
        queued); unless one joined meanwhile, it goes to storage at once, in this task, as a batch of one."""
        n = max(0, min(len(dest), attr.length - offset))
        if n == 0:
            return 0
        items = await self._aio._read_items(attr, offset, dest[:n])
        if alone and not self._pending:
            self.batches += 1
            self.reads += 1
            await self._aio.storage.read(items)
        else:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            if not self._pending:
                loop.call_soon(self._flush)
            self._pending.append((items, fut))
            await fut
        for it in items:
            if it.error is not None:
                raise it.error
        return n

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        self.batches += 1
        self.reads += len(batch)
        task = asyncio.ensure_future(self._aio.storage.read([it for items, _ in batch for it in items]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t: self._done(t, batch))

    def close(self) -> None:
        """Cancel the batches in flight (their callers' reads fail with CancelledError)."""
        for task in list(self._tasks):
            task.cancel()

    @staticmethod
    def _done(task: asyncio.Task, batch) -> None:
        err = None if task.cancelled() else task.exception()
        for _, fut in batch:
            if fut.done():
                continue
            if task.cancelled():
                fut.cancel()
            elif err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(None)
