"""FileReader: random access to the samples of one or many .ffr files.

    r = FileReader("/data/train", client=fs)   # a directory (its *.ffr, sorted), a file or a list
    batch = r.read([17, 4, 90210])              # numpy uint8 arrays, in the order asked
    one = r.read_one(5)

Paths are threefs paths when a `client` is given (files are resolved to inodes once, and each
`read()` is one `batch_read`: every sample of the batch in flight together, across chains), and OS
paths otherwise (local disk or a FUSE mount; `os.preadv` straight into the result). Global indices run
across the files in order. A batch is read into one numpy buffer and the samples are views of it (no
copy); samples that happen to sit back to back in a file are fetched as one IO. With check_data, every
sample's CRC32 is checked and a mismatch raises CHECKSUM_MISMATCH naming the sample.

A reader pickles to (client config, paths, check_data) and reconnects where it is unpickled (spawned
DataLoader workers); a forked worker keeps using it (the Client reconnects after fork by itself).
"""

from __future__ import annotations

import os
import zlib

import numpy as np

from threefs.common import limits
from threefs.common.status import StatusCode, status_error
from threefs.ffrecord import format as fmt
from threefs.ffrecord.backend import (IO_THREADS_FUSE, Opened, backend_for, fs_type, result_error,
                                      shared_client)

READ_SAMPLES_MAX = limits.BATCH_IOS_MAX  # indices in one read() call
VALIDATE_WINDOW_BYTES = 32 * limits.MiB  # validate() reads the samples in windows of this size
IO_THREADS_MAX = 256
CRC_THREADS = 2  # threads that check the samples of one big batch (zlib.crc32 runs without the GIL)
CRC_PARALLEL_BYTES_MIN = 1 << 20
_crc_executor = None


def _crc_pool():
    """One small pool per process (made on first use, so forked DataLoader workers make their own)."""
    global _crc_executor
    pid = os.getpid()
    if _crc_executor is None or _crc_executor[0] != pid:
        from concurrent.futures import ThreadPoolExecutor

        _crc_executor = (pid, ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="ffr-crc"))
    return _crc_executor[1]


def _paths_of(fnames) -> list[str]:
    if isinstance(fnames, (str, os.PathLike)):
        return [os.fspath(fnames)]
    if isinstance(fnames, (list, tuple)) and fnames:
        return [os.fspath(p) for p in fnames]
    raise status_error(StatusCode.INVALID_ARGUMENT,
                       f"fnames must be a path or a non-empty list of paths, not {fnames!r}")


class FileReader:
    """Reads samples of FFRecord files (v1 = HFAiLab's layout, v2 = ours) by global index."""

    def __init__(self, fnames, check_data: bool = True, *, client=None, io_threads: int | None = None):
        self.check_data = bool(check_data)
        self._io_threads = io_threads
        self._files = backend_for(client)
        self._opened: list[Opened] = []
        try:
            self.fnames = self._expand(_paths_of(fnames))
            if client is None:
                self._files.io_threads = self._local_io_threads(io_threads)
            self._tables = [self._load(path) for path in self.fnames]
        except BaseException:
            self.close()
            raise
        self._index()

    # -- opening ---------------------------------------------------------------------------------
    def _expand(self, paths: list[str]) -> list[str]:
        out = []
        for path in paths:
            listed = self._files.list_ffr(path)
            if listed is None:
                out.append(path)
            elif not listed:
                raise status_error(StatusCode.NOT_FOUND, f"{path}: directory holds no .ffr files")
            else:
                out += listed
        return out

    def _local_io_threads(self, io_threads: int | None) -> int:
        """Reads in flight for OS files: as asked, else IO_THREADS_FUSE on a FUSE mount, else 0."""
        if io_threads is not None:
            if not isinstance(io_threads, int) or not 0 <= io_threads <= IO_THREADS_MAX:
                raise status_error(StatusCode.INVALID_ARGUMENT,
                                   f"io_threads {io_threads!r} must be an int in [0, {IO_THREADS_MAX}]")
            return io_threads
        return IO_THREADS_FUSE if fs_type(self.fnames[0]).startswith("fuse") else 0

    def _load(self, path: str) -> fmt.Tables:
        opened = self._files.open_read(path)
        self._opened.append(opened)
        prefix = self._read_exact(opened, 0, min(fmt.PREFIX_BYTES, opened.size), f"{path} header")
        header = fmt.parse_prefix(prefix, opened.size, path)
        size = header.data_start - header.table_start
        tables = self._read_exact(opened, header.table_start, size, f"{path} tables")
        return fmt.parse_tables(header, prefix, tables, path)

    def _read_exact(self, opened: Opened, offset: int, nbytes: int, what: str) -> bytes:
        buf = bytearray(nbytes)
        if nbytes:
            [result] = self._files.read([(opened, offset, memoryview(buf))])
            err = result_error(result, nbytes, what)
            if err is not None:
                raise err
        return bytes(buf)

    def _index(self) -> None:
        """Global tables: sample i of the dataset is at (file _file_of[i], offset _start[i])."""
        counts = [t.header.n for t in self._tables]
        self._first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.n = int(self._first[-1])
        self._start = np.concatenate([t.offsets[:-1] for t in self._tables]) if self.n else np.zeros(0, np.int64)
        self._length = np.concatenate([np.diff(t.offsets) for t in self._tables]) if self.n else np.zeros(0, np.int64)
        self._crc = np.concatenate([t.checksums for t in self._tables]) if self.n else np.zeros(0, np.uint32)
        self._file_of = np.repeat(np.arange(len(self._tables), dtype=np.int32), counts)
        assert len(self._start) == len(self._length) == len(self._crc) == self.n

    # -- reading ---------------------------------------------------------------------------------
    def _check_indices(self, indices) -> np.ndarray:
        try:
            idx = np.asarray(indices)
        except (TypeError, ValueError) as e:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"indices must be a list of ints: {e}") from None
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"indices must be a flat list of ints, got {idx.dtype} of shape {idx.shape}")
        if idx.size > READ_SAMPLES_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"{idx.size} indices in one read exceed {READ_SAMPLES_MAX}; split the batch")
        idx = idx.astype(np.int64, copy=False)
        bad = (idx < 0) | (idx >= self.n)
        if bad.any():
            raise IndexError(f"sample index {int(idx[bad][0])} out of range: the dataset has {self.n} "
                             f"samples (indices 0..{self.n - 1}; negative indices are not accepted)")
        return idx

    def read(self, indices) -> list[np.ndarray]:
        """The samples at `indices` (any order, repeats allowed) as uint8 arrays, in that order."""
        return self._read(self._check_indices(indices), self.check_data)

    def _read(self, idx: np.ndarray, verify: bool) -> list[np.ndarray]:
        if not self._opened:
            raise status_error(StatusCode.BAD_FILE_HANDLE, f"reader of {self.fnames[0]} is closed")
        if idx.size == 0:
            return []
        starts, lengths, files = self._start[idx], self._length[idx], self._file_of[idx]
        order = np.lexsort((starts, files))  # file order: neighbours in a file become one IO
        s_start, s_len, s_file = starts[order], lengths[order], files[order]
        s_pos = np.cumsum(s_len) - s_len  # each sample's place in the batch buffer (sorted order)
        arena = np.empty(int(s_len.sum()), dtype=np.uint8)
        self._fetch(arena, s_start, s_len, s_file, s_pos, idx[order])
        pos = np.empty_like(s_pos)
        pos[order] = s_pos
        out = [arena[p:p + n] for p, n in zip(pos.tolist(), lengths.tolist())]
        if verify:
            self._verify(out, idx)
        return out

    def read_one(self, index: int) -> np.ndarray:
        """One sample as a uint8 array."""
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"index must be an int, not {index!r}")
        return self.read([index])[0]

    def _fetch(self, arena, s_start, s_len, s_file, s_pos, s_idx) -> None:
        """Read every run of back-to-back samples (sorted by file and offset) into the arena: one IO
        per run, all of them in one backend call (as columns: no Python object per run on threefs)."""
        new_run = np.ones(len(s_start), dtype=bool)
        new_run[1:] = (s_file[1:] != s_file[:-1]) | (s_start[1:] != (s_start + s_len)[:-1])
        heads = np.flatnonzero(new_run)
        run_len = np.diff(np.append(s_pos[heads], len(arena)))
        keep = heads[run_len > 0]  # empty samples need no IO
        lens = run_len[run_len > 0]
        r_file, r_start, r_pos = s_file[keep], s_start[keep], s_pos[keep]
        results = self._files.read_runs(self._opened, r_file, r_start, lens, arena, r_pos)
        lens = lens.tolist()
        for k, (result, n) in enumerate(zip(results, lens)):
            if result != n:  # short read or an exception: name the first sample of the run
                h = int(keep[k])
                err = result_error(result, n, "")
                raise status_error(err.code, f"reading sample {int(s_idx[h])} of "
                                   f"{self._opened[int(r_file[k])].path} at offset {int(r_start[k])} ({n} "
                                   f"bytes){err.message}")

    def _verify(self, samples: list[np.ndarray], idx: np.ndarray) -> None:
        crc = fmt.crc32
        if (crc is zlib.crc32 and len(samples) >= 2 * CRC_THREADS
                and sum(len(s) for s in samples) >= CRC_PARALLEL_BYTES_MIN):
            # zlib.crc32 lets go of the GIL on buffers over 5 KiB: big batches are checked on a few threads
            # (isal's crc32, when installed, is fast enough inline: a 4 MiB batch in ~70 us)
            step = -(-len(samples) // CRC_THREADS)
            parts = _crc_pool().map(lambda k: [crc(s) for s in samples[k:k + step]],
                                    range(0, len(samples), step))
            actual = [c for part in parts for c in part]
        else:
            actual = [crc(s) for s in samples]
        expected = self._crc[idx].tolist()
        if actual != expected:
            k = next(i for i, (a, e) in enumerate(zip(actual, expected)) if a != e)
            raise self._checksum_error(int(idx[k]), actual[k], expected[k])

    def _checksum_error(self, index: int, actual: int, expected: int):
        fid = int(self._file_of[index])
        local = index - int(self._first[fid])
        return status_error(StatusCode.CHECKSUM_MISMATCH, f"sample {index} (sample {local} of "
                            f"{self.fnames[fid]}, {int(self._length[index])} bytes at offset "
                            f"{int(self._start[index])}): checksum mismatch, stored 0x{expected:08x}, "
                            f"read 0x{actual:08x}; the file is corrupt")

    def validate(self, progress=None) -> None:
        """Check every sample's CRC32 (headers were checked at open), reading the whole dataset in
        windows. Raises CHECKSUM_MISMATCH naming the first bad sample. progress(nbytes) per window."""
        ends = self._start + self._length
        first = 0
        while first < self.n:
            file_end = int(self._first[self._file_of[first] + 1])
            limit = self._start[first] + VALIDATE_WINDOW_BYTES
            last = first + int(np.searchsorted(ends[first:file_end], limit, side="right")) - 1
            last = max(first, last)  # a sample larger than the window is read on its own
            samples = self._read(np.arange(first, last + 1, dtype=np.int64), verify=True)
            if progress is not None:
                progress(sum(len(s) for s in samples))
            first = last + 1

    # -- the reference's accessors ---------------------------------------------------------------
    def get_offsets(self, file_idx: int) -> np.ndarray:
        """Offsets of file `file_idx`'s samples, and its size as the last entry (int64[N+1])."""
        return self._tables[file_idx].offsets.copy()

    def get_checksums(self, file_idx: int) -> np.ndarray:
        return self._tables[file_idx].checksums.copy()

    def version_of(self, file_idx: int) -> int:
        return self._tables[file_idx].header.version

    def sample_lengths(self) -> np.ndarray:
        return self._length.copy()

    def __len__(self) -> int:
        return self.n

    def close(self) -> None:
        for opened in self._opened:
            self._files.close(opened)
        self._opened = []
        self._files.shutdown()

    def __del__(self):
        if self.__dict__.get("_opened"):  # a reader nobody closed must not leak descriptors
            try:
                self.close()
            except Exception:
                pass

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce__(self):
        client = self._files.client
        return (_reopen, (None if client is None else client.config, self.fnames, self.check_data,
                          self._io_threads))


def _reopen(config, fnames: list[str], check_data: bool, io_threads: int | None = None) -> FileReader:
    client = None if config is None else shared_client(config)
    return FileReader(fnames, check_data, client=client, io_threads=io_threads)
