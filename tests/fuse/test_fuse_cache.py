"""The kernel's page cache on the mount, with close-to-open consistency: an open keeps the pages cached of a
file that has not changed since, and drops them when it has (written through the Python library, through
another mount, or through this one; overwritten in place, grown, truncated, replaced by a rename).

Which pages are cached is read with mincore(2), so each test shows both halves: what must stay cached
stays (nothing is read again), and what changed is never served from the cache.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess

import pytest
from fuse_helpers import require_fuse, stop_daemon

from threefs.client import fuse_mount

PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (mapping a file faults nothing in)."""
    size = os.stat(path).st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = ctypes.create_string_buffer(-(-size // PAGE))
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pages(n: int) -> int:
    return -(-n // PAGE)


def test_unchanged_file_keeps_its_pages_and_a_library_overwrite_drops_them(mdir, fs, rng):
    path, tpath = mdir
    one, two = rng.randbytes(3 * MiB + 100), rng.randbytes(3 * MiB + 100)
    fs.write_bytes(f"{tpath}/f", one)
    assert read(f"{path}/f") == one
    assert cached_pages(f"{path}/f") == pages(len(one))
    with open(f"{path}/f", "rb") as f:  # an open of the unchanged file keeps them
        assert cached_pages(f"{path}/f") == pages(len(one))
        assert f.read() == one
    with fs.open(f"{tpath}/f", "r+b") as f:  # in place: same inode, same length
        f.write(two)
    with open(f"{path}/f", "rb") as f:
        assert cached_pages(f"{path}/f") == 0  # dropped at this open
        assert f.read() == two
    assert read(f"{path}/f") == two


def test_growth_and_truncate_by_the_library_are_seen_by_the_next_open(mdir, fs, rng):
    path, tpath = mdir
    a = rng.randbytes(100_000)
    fs.write_bytes(f"{tpath}/g", a)
    assert read(f"{path}/g") == a and os.stat(f"{path}/g").st_size == len(a)  # size cached by the kernel
    b = rng.randbytes(250_000)
    fs.batch_write([(f"{tpath}/g", len(a), b)])
    assert read(f"{path}/g") == a + b  # the open saw the new length, though the kernel cached the old one
    assert os.stat(f"{path}/g").st_size == len(a) + len(b)
    fs.truncate(f"{tpath}/g", 5000)
    assert read(f"{path}/g") == a[:5000]
    assert os.stat(f"{path}/g").st_size == 5000
    fs.truncate(f"{tpath}/g", 8000)  # grows with zeros: same inode, new truncate version
    assert read(f"{path}/g") == a[:5000] + bytes(3000)


def test_mmap_reads_follow_close_to_open(mdir, fs, rng):
    path, tpath = mdir
    one, two = rng.randbytes(2 * MiB), rng.randbytes(2 * MiB)
    fs.write_bytes(f"{tpath}/m", one)
    with open(f"{path}/m", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[:] == one
    with fs.open(f"{tpath}/m", "r+b") as f:
        f.seek(MiB)
        f.write(two[MiB:])
    with open(f"{path}/m", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[:] == one[:MiB] + two[MiB:]


def test_writes_through_the_mount_are_read_back_and_seen_by_the_library(mdir, fs, rng):
    path, tpath = mdir
    one = rng.randbytes(MiB + 7)
    with open(f"{path}/w", "wb") as f:
        f.write(one)
    assert read(f"{path}/w") == one and fs.read_bytes(f"{tpath}/w") == one
    with open(f"{path}/w", "r+b") as f:  # partial pages written through, read back from the same file
        f.seek(4000)
        f.write(b"x" * 300)
        f.seek(0)
        assert f.read() == one[:4000] + b"x" * 300 + one[4300:]
    want = one[:4000] + b"x" * 300 + one[4300:]
    assert read(f"{path}/w") == want and fs.read_bytes(f"{tpath}/w") == want
    os.truncate(f"{path}/w", 10)
    assert read(f"{path}/w") == want[:10] and fs.read_bytes(f"{tpath}/w") == want[:10]
    with open(f"{path}/w", "ab") as f:
        f.write(b"tail")
    assert read(f"{path}/w") == want[:10] + b"tail" and fs.stat(f"{tpath}/w").length == 14


def test_stat_while_writing_shows_the_written_size_and_a_new_mtime(mdir, rng):
    """No write-back cache: the daemon is the authority for size and mtime; a stat publishes what was
    written, so mtime moves with the write and does not move again at close."""
    path, _ = mdir
    with open(f"{path}/s", "wb") as f:
        f.write(b"a")
    before = os.stat(f"{path}/s")
    with open(f"{path}/s", "r+b") as f:
        f.write(rng.randbytes(70_000))
        f.flush()
        during = os.stat(f"{path}/s")
    after = os.stat(f"{path}/s")
    assert during.st_size == after.st_size == 70_000
    assert during.st_mtime_ns > before.st_mtime_ns
    assert after.st_mtime_ns == during.st_mtime_ns


def test_a_name_replaced_by_another_client_is_looked_up_again(mdir, fs, rng):
    """The kernel caches names for 30 s; an open of a name whose inode another client removed (the
    write-aside-then-rename pattern) is ESTALE to the kernel, which looks the name up again."""
    path, tpath = mdir
    one, two = rng.randbytes(5000), rng.randbytes(6000)
    fs.write_bytes(f"{tpath}/r", one)
    assert read(f"{path}/r") == one
    fs.write_bytes(f"{tpath}/r.tmp", two)
    fs.rename(f"{tpath}/r.tmp", f"{tpath}/r")
    assert read(f"{path}/r") == two
    assert os.stat(f"{path}/r").st_size == len(two)


@pytest.fixture
def second_mount(cluster, tmp_path):
    require_fuse()
    mnt = str(tmp_path / "second")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], str(tmp_path / "second.log"))
    yield mnt
    stop_daemon(proc, mnt)


def test_two_mounts_see_each_others_writes_at_open(mdir, second_mount, rng):
    path, tpath = mdir
    other = os.path.join(second_mount, tpath.lstrip("/"))
    one, two = rng.randbytes(2 * MiB + 3), rng.randbytes(2 * MiB + 3)
    with open(f"{path}/x", "wb") as f:
        f.write(one)
    assert read(f"{other}/x") == one
    assert cached_pages(f"{other}/x") == pages(len(one))
    with open(f"{path}/x", "r+b") as f:  # same length, in place
        f.write(two)
    assert read(f"{other}/x") == two
    with open(f"{other}/x", "ab") as f:  # and back the other way, growing it
        f.write(b"more")
    assert read(f"{path}/x") == two + b"more"
    assert subprocess.run(["cmp", f"{path}/x", f"{other}/x"]).returncode == 0
