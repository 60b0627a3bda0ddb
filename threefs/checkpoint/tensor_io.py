"""Moving tensor bytes: snapshot into a reusable host buffer, batch writes of that buffer, batch
reads straight into freshly allocated (or caller-given) tensors, checksums."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from threefs.checkpoint.format import (TensorEntry, TreeEncoder, align_up, numpy_dtype, torch_dtype,
                                       torch_dtype_name)
from threefs.common import crc32c
from threefs.common import limits
from threefs.common.buffers import aligned_buffer, prefault
from threefs.common.status import StatusCode, status_error

PIECE_BYTES_DEFAULT = 8 * limits.MiB  # one batch-write item; pieces start on chunk boundaries
READ_PIECE_BYTES = 64 * limits.MiB  # a tensor bigger than this is read as several items
READ_GROUP_BYTES = 256 * limits.MiB  # a load is read in groups this big, checksums overlapping the next
# Whole-file loads: groups of WHOLE_GROUP_BYTES, WHOLE_GROUPS_IN_FLIGHT of them read at once, so the disks of
# the storage services never idle while the last chunks of one group arrive and the next is not sent yet
# (cold loads, same run, 3 rounds: 2 x 128 MiB 0.54-1.32x safetensors, 1 x 256 MiB 0.61-0.97x; docs/checkpoint.md)
WHOLE_GROUP_BYTES = 128 * limits.MiB
WHOLE_GROUPS_IN_FLIGHT = 2
BATCH_ITEMS_MAX = 4096  # items per batch call (the client's limit is far higher; keeps replies bounded)


class Staging:
    """A host buffer reused from save to save: a fresh buffer costs a page fault per 4 KiB (the copy
    into it ran at ~1.7 GB/s fresh against ~8 GB/s reused on this machine), so it is also prefaulted."""

    def __init__(self):
        self._buf: memoryview | None = None

    def get(self, nbytes: int) -> np.ndarray:
        if self._buf is None or len(self._buf) < nbytes:
            self._buf = aligned_buffer(max(nbytes, 1))
            prefault(np.frombuffer(self._buf, dtype=np.uint8).ctypes.data, len(self._buf))
        return np.frombuffer(self._buf, dtype=np.uint8, count=nbytes)

    def release(self) -> None:
        self._buf = None


@dataclass
class Snapshot:
    tree: Any
    entries: list[TensorEntry]
    buf: np.ndarray  # the data file's bytes (entries point into it)


def _describe(name: str, t) -> tuple[str, str, list[int], int]:
    if isinstance(t, np.ndarray):
        return "numpy", t.dtype.str, list(t.shape), t.nbytes
    import torch

    if t.layout != torch.strided:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"tensor {name!r} has layout {t.layout}; only "
                           "dense (strided) tensors are saved: call .to_dense() first")
    if t.is_quantized or t.is_meta:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"tensor {name!r} is quantized or on the meta "
                           "device and has no plain bytes to save")
    return "torch", torch_dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()


def snapshot(state, staging: Staging, file_name: str) -> Snapshot:
    """Copy every tensor of `state` into one host buffer laid out as the data file will be.
    The caller may change its tensors as soon as this returns."""
    enc = TreeEncoder()
    tree = enc.encode(state)
    entries, off = [], 0
    for name, t in enc.tensors:
        kind, dtype, shape, nbytes = _describe(name, t)
        entries.append(TensorEntry(name, kind, dtype, shape, file_name, off, nbytes, 0))
        off = align_up(off + nbytes)
    buf = staging.get(off)
    for e, (_, t) in zip(entries, enc.tensors):
        if e.nbytes:
            copy_into(buf[e.offset:e.offset + e.nbytes], t)
    return Snapshot(tree, entries, buf)


def copy_into(dst: np.ndarray, t) -> None:
    """Copy tensor/array t (any device, any strides) into the uint8 slice dst."""
    if isinstance(t, np.ndarray):
        np.copyto(dst.view(t.dtype).reshape(t.shape), t, casting="no")
        return
    import torch

    torch.from_numpy(dst).view(t.dtype).view(t.shape).copy_(t.detach())


def checksum_all(buf: np.ndarray, entries: list[TensorEntry]) -> None:
    for e in entries:
        e.crc = crc32c.crc32c(memoryview(buf[e.offset:e.offset + e.nbytes]))


def write_pieces(client, path: str, buf: np.ndarray, chunk_size: int, piece_bytes: int) -> None:
    """Write buf to path (created) with batch writes of chunk-aligned pieces, many in flight."""
    piece = max(chunk_size, piece_bytes // chunk_size * chunk_size)
    view = memoryview(buf)
    items = [(path, off, view[off:off + piece]) for off in range(0, len(buf), piece)]
    if not items:
        client.batch_write([(path, 0, b"")], create=True)
        return
    for i in range(0, len(items), BATCH_ITEMS_MAX):
        client.batch_write(items[i:i + BATCH_ITEMS_MAX], create=True)


# -- load -------------------------------------------------------------------------------------------
def empty_like_entry(e: TensorEntry, back: bool = True):
    """A fresh tensor/array for entry `e`; with `back`, its pages already backed (huge pages where
    possible): the read then copies into memory at full speed instead of faulting every 4 KiB (see
    buffers.prefault). read_into(..., back=...) backs them itself, overlapped with the reads."""
    if e.kind == "numpy":
        out = np.empty(e.shape, dtype=numpy_dtype(e.dtype))
    else:
        import torch

        out = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
    if back:
        back_pages(out)
    return out


def back_pages(t) -> None:
    if isinstance(t, np.ndarray):
        prefault(t.ctypes.data, t.nbytes)
    else:
        prefault(t.data_ptr(), t.numel() * t.element_size())


def byte_view(t) -> memoryview | None:
    """A writable byte view of a contiguous CPU tensor/array, or None if it cannot be read into."""
    if isinstance(t, np.ndarray):
        if not t.flags.c_contiguous or not t.flags.writeable:
            return None
        return memoryview(t.reshape(-1).view(np.uint8))
    import torch

    if t.device.type != "cpu" or not t.is_contiguous() or t.layout != torch.strided:
        return None
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def matches(e: TensorEntry, t) -> bool:
    if e.kind == "numpy":
        return isinstance(t, np.ndarray) and t.dtype == numpy_dtype(e.dtype) and list(t.shape) == e.shape
    import torch

    return (isinstance(t, torch.Tensor) and t.dtype == torch_dtype(e.dtype) and list(t.shape) == e.shape)


def read_into(client, reads: list[tuple[TensorEntry, Any, Any]], verify: bool, where: str,
              back: frozenset | set = frozenset()) -> None:
    """reads: (entry, data file InodeAttr, destination tensor/array, contiguous CPU[, anything]).

    Batch reads of about READ_GROUP_BYTES each (big tensors as several items, so they spread over chains),
    pipelined: while group k+1 is read (by a helper thread waiting on the client), this thread checks the
    checksums of the tensors group k completed — crc32c runs outside the GIL, so the two overlap.
    `back`: ids of fresh destinations (empty_like_entry(back=False)) whose pages a third thread backs
    group by group ahead of the reads, instead of all of them before the first read is sent.

    With verify, each tensor's save-time crc32c is the end-to-end check, so the client's per-IO check on
    arrival is skipped (one crc32c pass over the bytes instead of two: ~0.1 CPU-s per GB on the client's
    event-loop thread). A tensor that fails is read again with that check on, which reads another replica
    when the bytes were damaged on the way; only if it fails again is the checkpoint called damaged."""
    items, owners, last_group, attr_of = [], [], {}, {}
    groups, group_bytes = [], 0
    for e, attr, dest, *_ in reads:
        if not e.nbytes:
            continue
        view = byte_view(dest)
        attr_of[id(e)] = attr
        for off in range(0, e.nbytes, READ_PIECE_BYTES):
            n = min(READ_PIECE_BYTES, e.nbytes - off)
            if not groups or group_bytes + n > READ_GROUP_BYTES or len(groups[-1]) >= BATCH_ITEMS_MAX:
                groups.append([])
                group_bytes = 0
            groups[-1].append(len(items))
            group_bytes += n
            items.append((attr, e.offset + off, view[off:off + n]))
            owners.append(e)
        last_group[id(e)] = len(groups) - 1
    checks: list[list[tuple[TensorEntry, Any]]] = [[] for _ in groups]
    fresh: list[list[Any]] = [[] for _ in groups]
    first_group: dict[int, int] = {}
    for k, g in enumerate(groups):
        for i in g:
            first_group.setdefault(id(owners[i]), k)
    for e, _, dest, *_ in reads:
        if verify and e.nbytes:
            checks[last_group[id(e)]].append((e, dest))
        if e.nbytes and id(dest) in back:
            fresh[first_group[id(e)]].append(dest)
    if not groups:
        return
    backer = ThreadPoolExecutor(1, thread_name_prefix="threefs-ckpt-back") if any(fresh) else None
    backed = [backer.submit(_back_all, f) if backer is not None else None for f in fresh]

    def read_group(k: int) -> list[int]:
        if backed[k] is not None:
            backed[k].result()
        if verify:
            return client.batch_read([items[i] for i in groups[k]], check_arrival=False)
        return client.batch_read([items[i] for i in groups[k]])

    try:
        _read_groups(client, groups, items, owners, checks, attr_of, read_group, where)
    finally:
        if backer is not None:
            for f in backed:
                f.cancel()
            backer.shutdown()


def _back_all(dests: list) -> None:
    for t in dests:
        back_pages(t)


def _read_groups(client, groups, items, owners, checks, attr_of, read_group, where) -> None:
    with ThreadPoolExecutor(1, thread_name_prefix="threefs-ckpt-read") as reader:
        pending = reader.submit(read_group, 0)
        for k in range(len(groups)):
            got = pending.result()
            if k + 1 < len(groups):
                pending = reader.submit(read_group, k + 1)
            for i, n in zip(groups[k], got):
                if n != len(items[i][2]):
                    e = owners[i]
                    raise status_error(StatusCode.CHECKSUM_MISMATCH, f"{where}: tensor {e.name!r} is cut "
                                       f"short in {e.file} (read {n} of {len(items[i][2])} bytes); the "
                                       "checkpoint is damaged")
            for e, dest in checks[k]:
                crc = crc32c.crc32c(byte_view(dest))
                if crc != e.crc:
                    crc = _read_again_checked(client, e, attr_of[id(e)], dest)
                if crc != e.crc:
                    raise status_error(StatusCode.CHECKSUM_MISMATCH,
                                       f"{where}: tensor {e.name!r} failed its checksum (stored {e.crc:#010x}, "
                                       f"read {crc:#010x}); the checkpoint is damaged")


def _read_again_checked(client, e: TensorEntry, attr, dest) -> int:
    """Read tensor e again with the client's per-IO check on arrival (bytes damaged between storage and
    here fail it and are read from another replica); the crc32c of what arrived. dest: the tensor, or
    a byte memoryview of its bytes."""
    view = dest if isinstance(dest, memoryview) else byte_view(dest)
    client.batch_read([(attr, e.offset + off, view[off:off + min(READ_PIECE_BYTES, e.nbytes - off)])
                       for off in range(0, e.nbytes, READ_PIECE_BYTES)])
    return crc32c.crc32c(view)


# -- whole-file load --------------------------------------------------------------------------------
def read_file_whole(client, attr, entries: list[TensorEntry], verify: bool, where: str) -> list:
    """Load every tensor of `entries` (all in the data file `attr`) as views into ONE fresh host buffer
    laid out as the file, read in chunk-aligned pieces: every storage IO is a whole chunk received
    straight into its final place (no IO split at a tensor boundary, no partial-chunk check on storage,
    no small IO copied out of a packed reply). Returns a tensor/array per entry, in order.

    The tensors share that buffer (each has its own torch storage over its own bytes): it is freed
    when the last of them is. Pages are backed group by group on a helper thread ahead of the reads;
    groups of WHOLE_GROUP_BYTES (WHOLE_GROUPS_IN_FLIGHT at once) are pipelined with the checksums as in read_into."""
    need = max((e.offset + e.nbytes for e in entries if e.nbytes), default=0)
    buf = aligned_buffer(max(need, 1))
    arr = np.frombuffer(buf, dtype=np.uint8, count=max(need, 1))
    chunk = attr.layout.chunk_size if attr.layout is not None and attr.layout.chunk_size else limits.MiB
    piece = max(chunk, READ_PIECE_BYTES // chunk * chunk)
    per_group = max(1, WHOLE_GROUP_BYTES // piece)
    pieces = [(off, min(piece, need - off)) for off in range(0, need, piece)]
    groups = [pieces[i:i + per_group] for i in range(0, len(pieces), per_group)]
    ends = [g[-1][0] + g[-1][1] for g in groups]
    checks: list[list[TensorEntry]] = [[] for _ in groups]
    if verify:
        import bisect

        for e in entries:
            if e.nbytes:
                checks[bisect.bisect_left(ends, e.offset + e.nbytes)].append(e)
    view = memoryview(buf)
    base = arr.ctypes.data

    def back(k: int) -> None:
        start, end = groups[k][0][0], ends[k]
        prefault(base + start, end - start)

    def read_group(k: int) -> None:
        backed[k].result()
        items = [(attr, off, view[off:off + n]) for off, n in groups[k]]
        got = (client.batch_read(items, check_arrival=False) if verify else client.batch_read(items))
        for (off, n), g in zip(groups[k], got):
            if g != n:
                cut = off + g
                e = min((e for e in entries if e.nbytes and e.offset + e.nbytes > cut), key=lambda e: e.offset)
                raise status_error(StatusCode.CHECKSUM_MISMATCH, f"{where}: tensor {e.name!r} is cut short in "
                                   f"{e.file} (the file ends at byte {cut}, the tensor at {e.offset + e.nbytes}); "
                                   "the checkpoint is damaged")

    backer = ThreadPoolExecutor(1, thread_name_prefix="threefs-ckpt-back")
    backed = [backer.submit(back, k) for k in range(len(groups))]
    pending: list = []
    try:
        with ThreadPoolExecutor(WHOLE_GROUPS_IN_FLIGHT, thread_name_prefix="threefs-ckpt-read") as reader:
            pending = [reader.submit(read_group, k) for k in range(min(WHOLE_GROUPS_IN_FLIGHT, len(groups)))]
            for k in range(len(groups)):
                pending[k].result()
                if k + WHOLE_GROUPS_IN_FLIGHT < len(groups):
                    pending.append(reader.submit(read_group, k + WHOLE_GROUPS_IN_FLIGHT))
                for e in checks[k]:
                    part = view[e.offset:e.offset + e.nbytes]
                    crc = crc32c.crc32c(part)
                    if crc != e.crc:
                        crc = _read_again_checked(client, e, attr, part)
                    if crc != e.crc:
                        raise status_error(StatusCode.CHECKSUM_MISMATCH,
                                           f"{where}: tensor {e.name!r} failed its checksum (stored {e.crc:#010x}, "
                                           f"read {crc:#010x}); the checkpoint is damaged")
    finally:
        for f in backed + pending:
            f.cancel()
        backer.shutdown()
    return [_view_of(e, buf) for e in entries]


def _view_of(e: TensorEntry, buf: memoryview):
    """Entry e's tensor/array over its bytes of buf (a fresh one if it has no bytes)."""
    if not e.nbytes:
        return empty_like_entry(e, back=False)
    if e.kind == "numpy":
        return np.frombuffer(buf, dtype=numpy_dtype(e.dtype), count=_count(e), offset=e.offset
                             ).reshape(e.shape)
    import torch

    flat = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
    return flat.view(torch_dtype(e.dtype)).view(e.shape)


def _count(e: TensorEntry) -> int:
    return e.nbytes // numpy_dtype(e.dtype).itemsize
