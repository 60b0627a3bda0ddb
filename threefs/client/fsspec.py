"""fsspec adapter: `threefs://` for pandas, pyarrow, DuckDB, Dask and anything else that speaks fsspec.

    import pandas as pd
    df = pd.read_parquet("threefs:///data/x.parquet")               # config from $THREEFS_CONFIG
    df.to_parquet("threefs:///data/y.parquet", storage_options={"config": ".threefs/client.toml"})

    import duckdb
    from threefs.client.fsspec import DuckDBThreeFSFileSystem
    duckdb.register_filesystem(DuckDBThreeFSFileSystem())
    duckdb.sql("select count(*) from read_parquet('threefs:///data/x.parquet')")

(DuckDB reads one open file from several threads, each read as two calls, seek() then read(); the
DuckDB flavour gives each thread its own position so that every read lands where its thread seeked.
A plain ThreeFSFileSystem's files have one position, as Python files do, and would mix them up.)

A thin layer over threefs.client.Client (registered by the `fsspec.specs` entry point): paths are
absolute threefs paths (`threefs:///a/b`, and `threefs://a/b` means `/a/b` too); files are the client's
File objects (read-ahead, write-behind); ranged reads go straight into one buffer.
"""

from __future__ import annotations

import io
import os
import threading

from fsspec.spec import AbstractFileSystem

from threefs.client.client import Client
from threefs.common.config import ClientConfig
from threefs.common.status import StatusCode, status_error
from threefs.rpc.schemas import meta as m

TYPES = {m.FILE: "file", m.DIRECTORY: "directory", m.SYMLINK: "link"}


class ThreeFSFileSystem(AbstractFileSystem):
    protocol = "threefs"
    root_marker = "/"

    def __init__(self, config: str | os.PathLike | ClientConfig | None = None, client: Client | None = None,
                 **kwargs):
        """config: a client.toml path or ClientConfig (default $THREEFS_CONFIG, ./.threefs/client.toml);
        client: an already connected Client to share."""
        super().__init__(**kwargs)
        self._owned = client is None
        self.client = client or Client.connect(config)

    @classmethod
    def _strip_protocol(cls, path) -> str:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = os.fspath(path)
        if path.startswith("threefs://"):
            path = path[len("threefs://"):]
        elif path.startswith("threefs::"):
            path = path[len("threefs::"):]
        return "/" + path.strip("/")

    def unstrip_protocol(self, name: str) -> str:
        return "threefs://" + self._strip_protocol(name)

    # -- metadata --------------------------------------------------------------------------------
    def _entry(self, path: str, attr: m.InodeAttr) -> dict:
        info = {"name": path, "size": attr.length if attr.type != m.DIRECTORY else 0,
                "type": TYPES.get(attr.type, "other"), "inode": attr.inode, "mode": attr.mode,
                "nlink": attr.nlink, "uid": attr.uid, "gid": attr.gid, "mtime": attr.mtime_ns / 1e9,
                "created": attr.ctime_ns / 1e9}
        if attr.type == m.SYMLINK:
            info["destination"] = attr.symlink_target
        return info

    def info(self, path, **kwargs) -> dict:
        path = self._strip_protocol(path)
        return self._entry(path, self.client.stat(path))

    def ls(self, path, detail=True, **kwargs):
        path = self._strip_protocol(path)
        attr = self.client.stat(path)
        if attr.type != m.DIRECTORY:
            entries = [self._entry(path, attr)]
        else:
            names = sorted(e.name for e in self.client.scandir(path))
            paths = [f"{path.rstrip('/')}/{n}" for n in names]
            entries = [self._entry(p, a) for p, a in zip(paths, self.client.batch_stat(paths, follow=True))
                       if isinstance(a, m.InodeAttr)]
        return entries if detail else [e["name"] for e in entries]

    def created(self, path):
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["created"], datetime.timezone.utc)

    def modified(self, path):
        import datetime

        return datetime.datetime.fromtimestamp(self.info(path)["mtime"], datetime.timezone.utc)

    # -- namespace -------------------------------------------------------------------------------
    def mkdir(self, path, create_parents=True, **kwargs):
        self.client.mkdir(self._strip_protocol(path), parents=create_parents)

    def makedirs(self, path, exist_ok=False):
        self.client.mkdir(self._strip_protocol(path), parents=True, exist_ok=exist_ok)

    def rmdir(self, path):
        self.client.rmdir(self._strip_protocol(path))

    def _rm(self, path):
        path = self._strip_protocol(path)
        if self.client.stat(path).type == m.DIRECTORY:
            self.client.rmdir(path)
        else:
            self.client.remove(path)

    def rm_file(self, path):
        self._rm(path)

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        """A rename in meta: directories move whole, no data is copied."""
        if isinstance(path1, list) or isinstance(path2, list):
            return super().mv(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        self.client.rename(self._strip_protocol(path1), self._strip_protocol(path2))

    def cp_file(self, path1, path2, **kwargs):
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        with self.client.open(src, "rb") as fin, self.client.open(dst, "wb") as fout:
            while piece := fin.read(8 << 20):
                fout.write(piece)

    # -- data ------------------------------------------------------------------------------------
    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if not autocommit:
            raise NotImplementedError("threefs writes are visible at close; transactions are not supported")
        return self.client.open(self._strip_protocol(path), mode)

    def cat_file(self, path, start=None, end=None, **kwargs) -> bytes:
        """Bytes [start, end) (negative: from the end), read in one batch straight into the result."""
        path = self._strip_protocol(path)
        attr = self.client.stat(path)
        size = attr.length
        start = 0 if start is None else (max(0, size + start) if start < 0 else min(start, size))
        end = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
        if end <= start:
            return b""
        buf = bytearray(end - start)
        n = self.client.batch_read([(attr, start, buf)])[0]
        del buf[n:]
        return bytes(buf)

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        path = self._strip_protocol(path)
        if mode == "create" and self.client.exists(path):
            raise FileExistsError(path)
        with self.client.open(path, "wb") as f:
            f.write(value)

    def touch(self, path, truncate=True, **kwargs):
        path = self._strip_protocol(path)
        if truncate or not self.client.exists(path):
            with self.client.open(path, "wb"):
                pass

    def close(self) -> None:
        """Close the client this filesystem connected (not one passed in)."""
        if self._owned:
            self.client.close()


class PositionPerThreadReader(io.RawIOBase):
    """A read-only file whose position is kept per thread: each read is one positional batch read at
    the position its own thread last seeked to (or 0). Made for DuckDB, whose fsspec bridge reads a
    shared handle from its worker threads as seek(location) then read(n). The length is the file's at
    open (readers of a file being written see what was committed then)."""

    def __init__(self, client: Client, path: str):
        super().__init__()
        attr = client.stat(path)
        if attr.type == m.DIRECTORY:
            raise IsADirectoryError(21, "Is a directory", path)
        self._client, self._attr, self.name = client, attr, path
        self._local = threading.local()

    @property
    def size(self) -> int:
        return self._attr.length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def _pos(self) -> int:
        return getattr(self._local, "pos", 0)

    def tell(self) -> int:
        self._checkClosed()
        return self._pos()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos(), io.SEEK_END: self._attr.length}.get(whence)
        if base is None:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"invalid whence {whence}")
        if base + offset < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"negative seek position {base + offset}")
        self._local.pos = base + offset
        return self._local.pos

    def readinto(self, b) -> int:
        self._checkClosed()
        view = memoryview(b).cast("B")
        pos = self._pos()
        n = min(len(view), max(0, self._attr.length - pos))
        if n == 0:
            return 0
        got = self._client.batch_read([(self._attr, pos, view[:n])])[0]
        self._local.pos = pos + got
        return got

    def read(self, size: int = -1) -> bytes:
        self._checkClosed()
        if size is None or size < 0:
            size = max(0, self._attr.length - self._pos())
        buf = bytearray(size)
        got = self.readinto(buf)
        del buf[got:]
        return bytes(buf)

    def readall(self) -> bytes:
        return self.read(-1)


class DuckDBThreeFSFileSystem(ThreeFSFileSystem):
    """`threefs://` for duckdb.register_filesystem: files opened for reading keep a position per thread
    (PositionPerThreadReader), which DuckDB's multi-threaded seek-then-read needs; writes are the
    client's File objects, as in ThreeFSFileSystem."""

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if mode == "rb":
            return PositionPerThreadReader(self.client, self._strip_protocol(path))
        return super()._open(path, mode, block_size=block_size, autocommit=autocommit,
                             cache_options=cache_options, **kwargs)
