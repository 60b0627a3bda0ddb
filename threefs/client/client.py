"""The synchronous client: `threefs.connect()` -> Client.

    import threefs
    fs = threefs.connect()                      # ./.threefs/client.toml, $THREEFS_CONFIG or a path
    with fs.open("/data/x.bin", "wb") as f:
        f.write(b"...")
    fs.batch_read([("/data/x.bin", 0, buf1), ("/data/x.bin", 4096, buf2)])
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from threefs.client.aio import AsyncClient, open_flags
from threefs.client.file import RawFile
from threefs.client.loop import LoopThread
from threefs.common.config import ClientConfig, find_client_config, load_toml
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.rpc.client import as_bytes_view
from threefs.rpc.schemas import meta as m


class Client:
    def __init__(self, config: ClientConfig):
        self.config = config
        self._loop = LoopThread()
        self.aio = AsyncClient(config)
        try:
            self._run(self.aio.start())
        except BaseException:
            self._loop.stop()
            raise

    @classmethod
    def connect(cls, config: str | os.PathLike | ClientConfig | None = None) -> "Client":
        if not isinstance(config, ClientConfig):
            config = load_toml(find_client_config(str(config) if config else None), ClientConfig)
        return cls(config)

    def _run(self, coro):
        return self._loop.run(coro)

    def close(self) -> None:
        if self._loop is not None:
            try:
                self._run(self.aio.close())
            finally:
                self._loop.stop()
                self._loop = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- namespace -------------------------------------------------------------------------------
    def stat(self, path: str) -> m.InodeAttr:
        return self._run(self.aio.stat(path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
            return True
        except FileNotFoundError:
            return False

    def listdir(self, path: str = "/") -> list[str]:
        return [e.name for e in self._run(self.aio.listdir(path))]

    def scandir(self, path: str = "/") -> list[m.DirEntry]:
        return self._run(self.aio.listdir(path))

    def mkdir(self, path: str, mode: int = 0o755, parents: bool = False, exist_ok: bool = False,
              chunk_size: int = 0, stripe: int = 0) -> m.InodeAttr:
        try:
            return self._run(self.aio.mkdir(path, mode, parents, chunk_size, stripe))
        except FileExistsError:
            if exist_ok and self.stat(path).type == m.DIRECTORY:
                return self.stat(path)
            raise

    def remove(self, path: str) -> None:
        self._run(self.aio.remove(path))

    unlink = remove

    def rmdir(self, path: str) -> None:
        self._run(self.aio.rmdir(path))

    def rename(self, src: str, dst: str, noreplace: bool = False) -> None:
        self._run(self.aio.rename(src, dst, noreplace))

    def truncate(self, path: str, length: int) -> m.InodeAttr:
        return self._run(self.aio.truncate(path, length))

    # -- files -----------------------------------------------------------------------------------
    def open(self, path: str, mode: str = "rb", buffering: int = -1, *, chunk_size: int = 0,
             stripe: int = 0, perm: int = 0o644):
        """Open a file in a binary mode. buffering=0 gives the raw file (no Python-side buffer)."""
        flags, readable, writable = open_flags(mode)
        rsp = self._run(self.aio.open(path, flags, perm, chunk_size, stripe))
        if rsp.attr.type == m.DIRECTORY:
            raise status_error(StatusCode.IS_DIRECTORY, f"{path} is a directory")
        raw = RawFile(self, path, rsp, flags, readable, writable)
        if buffering == 0:
            return raw
        size = buffering if buffering > 1 else rsp.attr.layout.chunk_size
        if readable and writable:
            return io.BufferedRandom(raw, size)
        return io.BufferedWriter(raw, size) if writable else io.BufferedReader(raw, size)

    def read_bytes(self, path: str) -> bytes:
        with self.open(path, "rb") as f:
            return f.read()

    def write_bytes(self, path: str, data) -> int:
        with self.open(path, "wb", buffering=0) as f:
            return f.write(data)

    def put(self, local: str | os.PathLike, remote: str, piece_bytes: int = 64 << 20) -> int:
        """Copy a local file in: large pieces, each written to many chunks in parallel."""
        total = 0
        with open(local, "rb") as src, self.open(remote, "wb", buffering=0) as dst:
            buf = bytearray(piece_bytes)
            while n := src.readinto(buf):
                total += dst.write(memoryview(buf)[:n])
        return total

    def get(self, remote: str, local: str | os.PathLike, piece_bytes: int = 64 << 20) -> int:
        total = 0
        with self.open(remote, "rb", buffering=0) as src, open(local, "wb") as dst:
            buf = bytearray(piece_bytes)
            while n := src.readinto(buf):
                dst.write(memoryview(buf)[:n])
                total += n
        return total

    def batch_read(self, items, *, raise_on_error: bool = True) -> list:
        """Read many (file, offset, buffer) items with all IOs in flight together.

        `file` is a path, an InodeAttr or an open RawFile; `buffer` any writable contiguous buffer
        (bytearray, memoryview, numpy array). Returns bytes read per item (short at end of file); with
        raise_on_error=False failed items hold their exception instead.
        """
        attrs: dict[str, m.InodeAttr] = {}
        requests = []
        for file, offset, buf in items:
            if isinstance(file, m.InodeAttr):
                attr = file
            elif isinstance(file, RawFile):
                attr = file._attr_now()
            else:
                path = os.fspath(file)
                attr = attrs.get(path) or attrs.setdefault(path, self.stat(path))
            requests.append((attr, offset, as_bytes_view(buf)))
        results = self._run(self.aio.batch_read(requests))
        if raise_on_error:
            for r in results:
                if isinstance(r, ThreeFSError):
                    raise r
        return results

    def walk_files(self, path: str):
        """Yield (path, attr) of every file under path, depth first."""
        for entry in self.scandir(path):
            child = str(Path(path) / entry.name)
            if entry.type == m.DIRECTORY:
                yield from self.walk_files(child)
            else:
                yield child, self.stat(child)
