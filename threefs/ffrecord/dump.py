"""dump(): write any indexable dataset (len() and [i]) to FFRecord files.

    dump(dataset, "/data/train", nfiles=8, client=fs, encode=my_serialiser)

nfiles == 1 writes one file at `path` (which must end in .ffr); more write `path/PART_{k:05d}.ffr`
with ceil(n / nfiles) samples each (the reference's naming, so its readers and ours find them in
order). Each item must be bytes-like, or `encode(item)` must make it so.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from threefs.common.status import StatusCode, status_error
from threefs.ffrecord import format as fmt
from threefs.ffrecord.backend import backend_for
from threefs.ffrecord.writer import FileWriter

FILES_MAX = 100_000  # output files of one dump


def part_name(path: str, k: int) -> str:
    return f"{path.rstrip('/')}/PART_{k:05d}.ffr"


def plan(n: int, nfiles: int) -> list[tuple[int, int]]:
    """[(first sample, count)] per file: ceil(n / nfiles) samples each, the last one shorter (and
    fewer files than asked when they would be empty, as the reference does)."""
    if not isinstance(nfiles, int) or not 1 <= nfiles <= FILES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"nfiles {nfiles!r} must be in [1, {FILES_MAX}]")
    if nfiles == 1:
        return [(0, n)]
    per = max(1, -(-n // nfiles))
    return [(first, min(per, n - first)) for first in range(0, n, per)]


def dump(dataset, path, nfiles: int, *, client=None, encode: Callable | None = None,
         version: int = fmt.VERSION_DEFAULT, progress=None) -> list[str]:
    """Write `dataset` into `nfiles` FFRecord files; returns their paths. progress(1) per sample."""
    path = os.fspath(path)
    n = len(dataset)
    parts = plan(n, nfiles)
    if nfiles == 1:
        names = [path]
    else:
        backend_for(client).makedirs(path)
        names = [part_name(path, k) for k in range(len(parts))]
    for name, (first, count) in zip(names, parts):
        with FileWriter(name, count, client=client, version=version) as w:
            for i in range(first, first + count):
                item = dataset[i]
                w.write_one(encode(item) if encode is not None else _bytes_like(item, i))
                if progress is not None:
                    progress(1)
    return names


def _bytes_like(item, i: int):
    if isinstance(item, (bytes, bytearray, memoryview)) or hasattr(item, "__buffer__") \
            or hasattr(item, "__array_interface__"):
        return item
    raise status_error(StatusCode.INVALID_ARGUMENT, f"dataset item {i} is a {type(item).__name__}, not "
                       "bytes-like; pass encode= (e.g. pickle.dumps or a custom serialiser)")
