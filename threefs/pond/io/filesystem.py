"""File-system operations of pond, for local paths (a local disk or the threefs FUSE mount) and for
`threefs://` paths (straight through the threefs client, no mount needed).

Everything a task produces lives under one job directory; removing a job's temporaries is one
recursive remove: `remove_path` — on `threefs://` one `remove_tree` call to meta, instead of a walk.
"""

from __future__ import annotations

import functools
import glob as globlib
import os
import shutil

THREEFS_PREFIX = "threefs://"


def is_threefs(path: str) -> bool:
    return str(path).startswith(THREEFS_PREFIX)


_config: list = [None]
_mount: list = [None]


def configure(config_path, mount=None) -> None:
    """Use this client config for threefs:// paths in this process (workers get the driver's), and, when
    `mount` is the FUSE mount point of the same cluster, move the bulk data of threefs:// paths through it."""
    if config_path and config_path != _config[0]:
        _config[0] = config_path
        reset_threefs_fs()
    _mount[0] = mount or None


def current_mount():
    return _mount[0]


def data_view(path: str) -> str:
    """Where DuckDB and Arrow read/write `path`: the mount path of a threefs:// path when a mount is
    configured (per operation, the faster route: see docs/pond.md), else the path itself. Metadata
    operations (rename, link, remove_tree) stay on the client."""
    if _mount[0] and is_threefs(path):
        return os.path.join(_mount[0], _strip(path).lstrip("/"))
    return path


def current_config():
    return _config[0] or os.environ.get("THREEFS_CONFIG")


@functools.lru_cache(maxsize=None)
def threefs_fs():
    """One fsspec file system per process (config from configure(), $THREEFS_CONFIG or ./.threefs/client.toml)."""
    import fsspec
    return fsspec.filesystem("threefs", config=current_config(), skip_instance_cache=True)


def reset_threefs_fs() -> None:
    """Forget this process's threefs:// file system and close its client (connections, loop thread): the
    next threefs_fs() connects with the config then current. A client dropped without close() kept its loop
    thread running to the end of the process (each configure() to another cluster left one behind), and a
    daemon thread still inside the event loop while the interpreter finalises can crash the exit."""
    if threefs_fs.cache_info().currsize:
        fs = threefs_fs()  # the cached one
        threefs_fs.cache_clear()
        _duckdb_fs_over.cache_clear()  # (it shares fs's client)
        fs.close()


def duckdb_fs():
    """The file system DuckDB gets for threefs:// paths (per-thread file positions, which its
    multi-threaded reads need: see threefs.client.fsspec.DuckDBThreeFSFileSystem); shares the client of
    threefs_fs()."""
    return _duckdb_fs_over(threefs_fs())


@functools.lru_cache(maxsize=4)
def _duckdb_fs_over(base):
    from threefs.client.fsspec import DuckDBThreeFSFileSystem
    return DuckDBThreeFSFileSystem(client=base.client, skip_instance_cache=True)


def register_with_duckdb(con) -> None:
    """Let DuckDB connection `con` read and write threefs:// paths (once per connection)."""
    if "threefs" in con.list_filesystems():
        return
    con.register_filesystem(duckdb_fs())


def _strip(path: str) -> str:
    return "/" + path[len(THREEFS_PREFIX):].strip("/")


def join(*parts: str) -> str:
    return os.path.join(*parts)


def glob(pattern: str, recursive: bool = False) -> list[str]:
    if is_threefs(pattern):
        fs = threefs_fs()
        found = fs.glob(_strip(pattern)) if any(c in pattern for c in "*?[") else (
            [_strip(pattern)] if fs.exists(_strip(pattern)) else [])
        return sorted(THREEFS_PREFIX + p if p.startswith("/") else THREEFS_PREFIX + "/" + p for p in found)
    return sorted(globlib.glob(pattern, recursive=recursive))


def isdir(path: str) -> bool:
    if is_threefs(path):
        return threefs_fs().isdir(_strip(path))
    return os.path.isdir(path)


def exists(path: str) -> bool:
    if is_threefs(path):
        return threefs_fs().exists(_strip(path))
    return os.path.exists(path)


def makedirs(path: str) -> None:
    if is_threefs(path):
        threefs_fs().makedirs(_strip(path), exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def listdir(path: str) -> list[str]:
    if is_threefs(path):
        return sorted(os.path.basename(p) for p in threefs_fs().ls(_strip(path), detail=False))
    return sorted(os.listdir(path))


def rename(src: str, dst: str) -> None:
    """Atomic rename (a task's staging directory becomes its output directory in one step)."""
    if is_threefs(src):
        threefs_fs().client.rename(_strip(src), _strip(dst))
    else:
        os.rename(src, dst)


def link_or_copy(src: str, dst: str) -> str:
    """Hard link src at dst (same file system), else copy; returns 'link' or 'copy'."""
    if is_threefs(src) and is_threefs(dst):
        threefs_fs().client.link(_strip(src), _strip(dst))
        return "link"
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        shutil.copyfile(src, dst)
        return "copy"


def remove_path(path: str) -> None:
    """Remove a file or a directory tree; a missing path is not an error."""
    if is_threefs(path):
        fs = threefs_fs()
        if fs.exists(_strip(path)):
            fs.client.remove_tree(_strip(path))
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def write_text(path: str, text: str) -> None:
    """Write a small file atomically (temp name + rename)."""
    tmp = path + ".tmp"
    if is_threefs(path):
        with threefs_fs().open(_strip(tmp), "wb") as f:
            f.write(text.encode())
    else:
        with open(tmp, "w") as f:
            f.write(text)
    rename(tmp, path)


def write_bytes(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    if is_threefs(path):
        with threefs_fs().open(_strip(tmp), "wb") as f:
            f.write(data)
    else:
        with open(tmp, "wb") as f:
            f.write(data)
    rename(tmp, path)


def read_bytes(path: str) -> bytes:
    if is_threefs(path):
        with threefs_fs().open(_strip(path), "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def arrow_filesystem_and_path(path: str):
    """(pyarrow filesystem or None, path) for pyarrow.parquet readers."""
    if is_threefs(path) and _mount[0]:
        return None, data_view(path)
    if is_threefs(path):
        return threefs_fs(), _strip(path)
    return None, path
