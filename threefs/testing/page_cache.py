"""The page cache, for tests and benchmarks of cold reads: evict a tree's files, and whether a directory's
file system can be read cold at all."""

from __future__ import annotations

import os


def drop_cache(directory: str | os.PathLike) -> None:
    """Evict every file under `directory` from the page cache (posix_fadvise DONTNEED after a sync, so their
    bytes are on disk first): the next read of them comes from the disk."""
    os.sync()
    for top, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(top, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def why_never_cold(directory: str | os.PathLike) -> str | None:
    """None if files under `directory` live on a disk file system that takes O_DIRECT; else why not (tmpfs
    holds every page in memory: nothing is ever cold there, and nothing can come past its page cache)."""
    directory = os.path.realpath(directory)
    best, fstype = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (directory == mnt or directory.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[2]
    if fstype in ("tmpfs", "ramfs"):
        return f"{directory} is on {fstype}: no cold reads there"
    probe = os.path.join(directory, ".o_direct_probe")
    with open(probe, "wb") as f:
        f.write(bytes(4096))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        return f"no O_DIRECT on the file system of {directory}: {e}"
    finally:
        os.unlink(probe)
    return None


def skip_unless_cold_reads(directory: str | os.PathLike) -> None:
    """pytest.skip, with why_never_cold's reason, where files under `directory` can never be read cold."""
    reason = why_never_cold(directory)
    if reason:
        import pytest

        pytest.skip(reason)
