"""File objects: `io.RawIOBase` over the client, so io.Buffered*, shutil and pyarrow work on them."""

from __future__ import annotations

import io
import os

from threefs.common.status import StatusCode, status_error
from threefs.rpc.schemas import meta as m


class RawFile(io.RawIOBase):
    """A threefs file opened in a binary mode. Reads and writes go straight to storage.

    The file's length is exact after close(); while open for writing it is the larger of the length at
    open and the highest byte written through this object.
    """

    def __init__(self, client, path: str, rsp: m.OpenRsp, flags: int, readable: bool, writable: bool):
        super().__init__()
        self._client = client
        self.name = path
        self.mode_flags = flags
        self._attr = rsp.attr
        self._session = rsp.session
        self._readable, self._writable = readable, writable
        self._pos = self._attr.length if flags & os.O_APPEND else 0
        self._written_end = -1

    @property
    def attr(self) -> m.InodeAttr:
        return self._attr

    def readable(self) -> bool:
        return self._readable

    def writable(self) -> bool:
        return self._writable

    def seekable(self) -> bool:
        return True

    def _length(self) -> int:
        return max(self._attr.length, self._written_end)

    def readinto(self, b) -> int:
        self._checkClosed()
        if not self._readable:
            raise io.UnsupportedOperation("file not open for reading")
        n = self._client._run(self._client.aio.read_into(self._attr_now(), self._pos, b))
        self._pos += n
        return n

    def _attr_now(self) -> m.InodeAttr:
        if self._written_end > self._attr.length:  # reads see our own writes
            a = self._attr
            return m.InodeAttr(a.inode, a.type, a.mode, a.uid, a.gid, a.nlink, self._written_end,
                               a.atime_ns, a.mtime_ns, a.ctime_ns, a.layout)
        return self._attr

    def write(self, b) -> int:
        self._checkClosed()
        if not self._writable:
            raise io.UnsupportedOperation("file not open for writing")
        if self.mode_flags & os.O_APPEND:
            self._pos = self._length()
        n = self._client._run(self._client.aio.write_at(self._attr, self._pos, b))
        self._pos += n
        self._written_end = max(self._written_end, self._pos)
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length()}.get(whence)
        if base is None:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"invalid whence {whence}")
        if base + offset < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        self._checkClosed()
        if not self._writable:
            raise io.UnsupportedOperation("file not open for writing")
        size = self._pos if size is None else size
        self._attr = self._client._run(self._client.aio.truncate(self.name, size))
        self._written_end = -1
        return size

    def fileno(self) -> int:
        raise io.UnsupportedOperation("threefs files have no OS file descriptor (use the FUSE mount)")

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._writable or self._session:
                self._attr = self._client._run(
                    self._client.aio.close_file(self._attr.inode, self._session, self._written_end))
        finally:
            super().close()
