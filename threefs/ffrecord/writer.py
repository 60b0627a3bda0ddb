"""FileWriter: write N samples into one .ffr file, published atomically.

    with FileWriter("/data/train/PART_00000.ffr", n, client=fs) as w:   # client=None: a local path
        for sample in samples:
            w.write_one(sample)                                        # any bytes-like buffer

Samples go to a hidden temporary sibling (`.NAME.ffr.tmp-PID-RAND`) starting after the space the
tables need; `close()` writes the header last and renames the file into place, so readers see either
nothing or the whole file, never a torn one. A writer left by an exception (or `abort()`) removes its
temporary file and publishes nothing.
"""

from __future__ import annotations

import os
from array import array

import numpy as np

from threefs.common.status import StatusCode, status_error
from threefs.ffrecord import format as fmt
from threefs.ffrecord.backend import backend_for, temp_name


def sample_view(buf, what: str) -> memoryview:
    """A flat byte view of a sample (bytes, bytearray, memoryview, a contiguous numpy array)."""
    if isinstance(buf, str):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{what} is a str; encode it to bytes first")
    try:
        view = memoryview(buf)
    except TypeError:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{what} is a {type(buf).__name__}, not a "
                           "bytes-like buffer; serialise it first (dump(..., encode=...))") from None
    if not view.c_contiguous:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{what} is not contiguous; copy it first "
                           "(numpy.ascontiguousarray)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class FileWriter:
    """Writes exactly `n` samples to `fname` (must end in .ffr). `version=1` writes the reference
    FFRecord layout (readable by HFAiLab's ffrecord), the default 2 adds magic, version and size."""

    def __init__(self, fname: str | os.PathLike, n: int, *, client=None,
                 version: int = fmt.VERSION_DEFAULT):
        fname = os.fspath(fname)
        if not fname.endswith(".ffr"):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{fname}: FFRecord file names end in .ffr")
        fmt.check_count(n)
        if version not in fmt.VERSIONS:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"FFRecord version {version!r} unknown (use 1 or 2)")
        self.fname, self.n, self.version, self.count = fname, n, version, 0
        self._files = backend_for(client)
        self._tmp = temp_name(fname)
        self._checksums = array("I")
        self._offsets = array("q")
        self._pos = fmt.data_start(version, n)
        self._f = self._files.create(self._tmp)
        self._f.seek(self._pos)  # the tables go in front once every sample is known

    def write_one(self, buf) -> None:
        """Append one sample (its CRC32 goes into the table)."""
        if self._f is None:
            raise status_error(StatusCode.BAD_FILE_HANDLE, f"{self.fname}: writer is closed")
        if self.count >= self.n:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"{self.fname}: all {self.n} samples are written already")
        view = sample_view(buf, f"sample {self.count}")
        self._checksums.append(fmt.crc32(view))
        self._offsets.append(self._pos)
        self._f.write(buf if isinstance(buf, bytes) else view)  # bytes can go out uncopied
        self._pos += len(view)
        self.count += 1

    def close(self) -> None:
        """Write the header and publish the file. Raises (and publishes nothing) if fewer than n
        samples were written."""
        if self._f is None:
            return
        if self.count != self.n:
            self.abort()
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{self.fname}: wrote {self.count} samples "
                               f"but the writer was opened for {self.n}; nothing was published")
        header = fmt.build_header(self.version, np.frombuffer(self._checksums, dtype=np.uint32),
                                  np.frombuffer(self._offsets, dtype=np.int64), self._pos)
        f, self._f = self._f, None
        try:
            f.seek(0)
            f.write(header)
            self._files.publish(f, self._tmp, self.fname)
        except BaseException:
            self._files.discard(f, self._tmp)
            raise

    def abort(self) -> None:
        """Drop what was written; the target name is left as it was."""
        if self._f is not None:
            f, self._f = self._f, None
            self._files.discard(f, self._tmp)

    def __enter__(self) -> "FileWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self):
        if getattr(self, "_f", None) is not None:  # never finished: leave no temp file behind
            try:
                self.abort()
            except Exception:
                pass
