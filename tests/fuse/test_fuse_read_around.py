"""Read-around (client/fuse_store.py): a small buffered read that misses the page cache brings the aligned
64 KiB window around it into the kernel's page cache (a second miss in the same 1 MiB region: the whole
region), so that re-reads never reach the daemon, while every byte read stays the file's current byte: at
the file's end, with a writer open on the same mount, after another client's overwrite, after a truncate,
and under concurrent random readers whose windows overlap pages locked by each other's requests.

Which pages are cached is read with mincore(2) (test_fuse_cache.cached_pages) after an open for writing,
which waits for the stores already handed to the daemon's store thread (a read-only open of an unchanged
file does not), so the counts are exact.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time

from test_fuse_cache import cached_pages as cached_now

KiB, MiB = 1 << 10, 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
WINDOW = 64 * KiB  # MountOptions.read_around_bytes
REGION = MiB  # MountOptions.read_around_region_bytes


def cached_pages(path: str) -> int:
    """The file's cached pages once the daemon's stores of it so far are in (an open for writing waits
    for them)."""
    os.close(os.open(path, os.O_WRONLY))
    return cached_now(path)


def pread(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def test_a_small_random_read_caches_its_window_and_nothing_else(mdir, fs, rng):
    path, tpath = mdir
    data = rng.randbytes(2 * MiB)
    fs.write_bytes(f"{tpath}/f", data)
    assert pread(f"{path}/f", 300 * KiB, 4096) == data[300 * KiB:304 * KiB]
    assert cached_pages(f"{path}/f") == WINDOW // PAGE  # [256 KiB, 320 KiB)
    fd = os.open(f"{path}/f", os.O_RDONLY)
    try:  # the stored pages hold the file's bytes, and a window of the next region joins the first
        assert os.pread(fd, WINDOW, 256 * KiB) == data[256 * KiB:256 * KiB + WINDOW]
        at = MiB + 700 * KiB + 50
        assert os.pread(fd, 100, at) == data[at:at + 100]
        assert cached_pages(f"{path}/f") == 2 * WINDOW // PAGE
        assert os.pread(fd, 2 * MiB, 0) == data
    finally:
        os.close(fd)


def test_a_second_miss_in_a_region_caches_the_whole_region(mdir, fs, rng):
    """A file read densely at random is cached a region per miss, not a window per miss; one read at
    random in each region (never a second) keeps to windows (the first test)."""
    path, tpath = mdir
    data = rng.randbytes(2 * MiB + 300 * KiB)  # the last region holds 300 KiB
    fs.write_bytes(f"{tpath}/f", data)
    fd = os.open(f"{path}/f", os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 300 * KiB) == data[300 * KiB:304 * KiB]
        assert os.pread(fd, 4096, 2 * MiB + 8192) == data[2 * MiB + 8192:2 * MiB + 12288]
        assert cached_pages(f"{path}/f") == 2 * WINDOW // PAGE
        assert os.pread(fd, 100, 700 * KiB + 50) == data[700 * KiB + 50:700 * KiB + 150]  # region 0 again
        assert cached_pages(f"{path}/f") == REGION // PAGE + WINDOW // PAGE
        assert os.pread(fd, 4096, 2 * MiB + 200 * KiB) == data[2 * MiB + 200 * KiB:2 * MiB + 204 * KiB]
        # the last region up to the file's end, and no further (the kernel's size stays the file's)
        assert cached_pages(f"{path}/f") == REGION // PAGE + 300 * KiB // PAGE
        assert os.fstat(fd).st_size == len(data)
        assert os.pread(fd, len(data), 0) == data
    finally:
        os.close(fd)


def test_reads_as_large_as_the_window_are_read_alone_and_then_by_region(mdir, fs, rng):
    """64 KiB random reads (a window's size: nothing around them to add) are read as asked, and the
    second miss in a region reads the whole region, as smaller reads do."""
    path, tpath = mdir
    data = rng.randbytes(2 * MiB)
    fs.write_bytes(f"{tpath}/f", data)
    fd = os.open(f"{path}/f", os.O_RDONLY)
    try:
        assert os.pread(fd, WINDOW, 128 * KiB) == data[128 * KiB:128 * KiB + WINDOW]
        assert os.pread(fd, WINDOW, MiB + 128 * KiB) == data[MiB + 128 * KiB:MiB + 128 * KiB + WINDOW]
        assert cached_pages(f"{path}/f") == 2 * WINDOW // PAGE  # the pages read, nothing around them
        assert os.pread(fd, WINDOW, 640 * KiB) == data[640 * KiB:640 * KiB + WINDOW]
        assert cached_pages(f"{path}/f") == REGION // PAGE + WINDOW // PAGE
    finally:
        os.close(fd)


def test_regions_off_keeps_to_windows(extra_mount, fs, rng):
    mnt = extra_mount(["--read-around-region-kb", "0"])
    fs.mkdir("/read-around-windows")
    data = rng.randbytes(MiB)
    fs.write_bytes("/read-around-windows/f", data)
    fd = os.open(f"{mnt}/read-around-windows/f", os.O_RDONLY)
    try:
        for off in (4096, 200 * KiB, 520 * KiB):
            assert os.pread(fd, 4096, off) == data[off:off + 4096]
    finally:
        os.close(fd)
    assert cached_pages(f"{mnt}/read-around-windows/f") == 3 * WINDOW // PAGE


def test_the_window_at_the_end_of_a_file_stops_at_its_length(mdir, fs, rng):
    path, tpath = mdir
    data = rng.randbytes(MiB + 50_000)  # the last window holds 50,000 bytes, its last page partly
    fs.write_bytes(f"{tpath}/f", data)
    assert pread(f"{path}/f", MiB + 8192, 4096) == data[MiB + 8192:MiB + 12288]
    assert os.stat(f"{path}/f").st_size == len(data)  # the store did not extend the kernel's size
    assert cached_pages(f"{path}/f") == -(-50_000 // PAGE)
    with open(f"{path}/f", "rb") as f:
        f.seek(MiB)
        assert f.read() == data[MiB:]  # the partial last page: its bytes, then the end of file
    with open(f"{path}/f", "rb") as f:
        assert f.read() == data


def test_another_clients_overwrite_is_seen_by_the_next_open_not_the_stored_pages(mdir, fs, rng):
    path, tpath = mdir
    one, two = rng.randbytes(4 * MiB), rng.randbytes(4 * MiB)
    fs.write_bytes(f"{tpath}/f", one)
    for off in (0, MiB + 200 * KiB, 2 * MiB + 520 * KiB, 3 * MiB + 900 * KiB):  # a window in each region
        assert pread(f"{path}/f", off + 4096, 4096) == one[off + 4096:off + 8192]
    assert cached_pages(f"{path}/f") == 4 * WINDOW // PAGE
    with fs.open(f"{tpath}/f", "r+b") as f:  # in place: same inode, same length
        f.write(two)
    with open(f"{path}/f", "rb") as f:
        assert cached_pages(f"{path}/f") == 0  # dropped at this open, stored pages too
        assert f.read() == two


def test_a_writer_on_the_same_mount_turns_read_around_off_and_its_writes_are_read(mdir, fs, rng):
    path, tpath = mdir
    data = bytearray(rng.randbytes(MiB))
    fs.write_bytes(f"{tpath}/f", bytes(data))
    w = os.open(f"{path}/f", os.O_WRONLY)
    r = os.open(f"{path}/f", os.O_RDONLY)
    try:
        assert os.pread(r, 4096, 300 * KiB) == data[300 * KiB:304 * KiB]
        assert cached_pages(f"{path}/f") == 1  # the page read, no window: a writer is open
        new = rng.randbytes(4096)
        assert os.pwrite(w, new, 308 * KiB) == 4096
        data[308 * KiB:312 * KiB] = new
        assert os.pread(r, 4096, 308 * KiB) == new
    finally:
        os.close(w)
    try:  # the writer is gone: windows again, of the new bytes
        assert os.pread(r, 4096, 600 * KiB) == data[600 * KiB:604 * KiB]
        assert os.pread(r, MiB, 0) == data
    finally:
        os.close(r)
    assert pread(f"{path}/f", 0, MiB) == data


def test_o_direct_reads_store_nothing(mdir, fs, rng):
    path, tpath = mdir
    data = rng.randbytes(MiB)
    fs.write_bytes(f"{tpath}/f", data)
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    fd = os.open(f"{path}/f", os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [buf], 300 * KiB) == 4096
        assert bytes(buf) == data[300 * KiB:304 * KiB]
    finally:
        os.close(fd)
    assert cached_pages(f"{path}/f") == 0


def test_a_truncate_after_read_around_leaves_the_new_length_and_bytes(mdir, fs, rng):
    path, tpath = mdir
    data = rng.randbytes(MiB)
    fs.write_bytes(f"{tpath}/f", data)
    assert pread(f"{path}/f", 900 * KiB, 4096) == data[900 * KiB:904 * KiB]
    os.truncate(f"{path}/f", 890 * KiB)
    assert os.stat(f"{path}/f").st_size == 890 * KiB
    assert pread(f"{path}/f", 0, MiB) == data[:890 * KiB]
    os.truncate(f"{path}/f", 950 * KiB)  # grown again: zeros past the cut, not the stored old bytes
    assert pread(f"{path}/f", 880 * KiB, 100 * KiB) == data[880 * KiB:890 * KiB] + bytes(60 * KiB)


def test_concurrent_random_readers_whose_windows_overlap_read_the_files_bytes(mdir, fs):
    """Four threads at random 4 KiB reads of one file: windows being stored cover pages other requests
    have locked (the store thread waits for them, the event loop never does); every read is checked."""
    path, tpath = mdir
    data = random.Random(15).randbytes(4 * MiB)
    fs.write_bytes(f"{tpath}/f", data)
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        fd = os.open(f"{path}/f", os.O_RDONLY)
        try:
            for _ in range(1500):
                off = rng.randrange(len(data) // 4096) * 4096
                got = os.pread(fd, 4096, off)
                if got != data[off:off + 4096]:
                    errors.append(f"thread {seed}: wrong bytes at {off}")
                    return
        finally:
            os.close(fd)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "readers hung"
    assert errors == []
    assert cached_pages(f"{path}/f") > 4 * MiB // PAGE // 2  # most of the file came in as windows
    assert pread(f"{path}/f", 0, 4 * MiB) == data


def test_a_request_across_two_windows_is_answered_whole(mdir, fs, rng):
    path, tpath = mdir
    data = rng.randbytes(MiB)
    fs.write_bytes(f"{tpath}/f", data)
    assert pread(f"{path}/f", 56 * KiB, 16 * KiB) == data[56 * KiB:72 * KiB]
    assert cached_pages(f"{path}/f") == 72 * KiB // PAGE  # the first window, then the request's end


def test_files_longer_than_the_limit_get_no_read_around(extra_mount, fs, rng):
    mnt = extra_mount(["--read-around-max-mb", "1"])
    fs.mkdir("/read-around-limit")
    small, big = rng.randbytes(MiB), rng.randbytes(MiB + PAGE)
    fs.write_bytes("/read-around-limit/small", small)
    fs.write_bytes("/read-around-limit/big", big)
    assert pread(f"{mnt}/read-around-limit/small", 300 * KiB, 4096) == small[300 * KiB:304 * KiB]
    assert pread(f"{mnt}/read-around-limit/big", 300 * KiB, 4096) == big[300 * KiB:304 * KiB]
    assert cached_pages(f"{mnt}/read-around-limit/small") == WINDOW // PAGE
    assert cached_pages(f"{mnt}/read-around-limit/big") == 1


def test_another_clients_truncate_is_seen_by_the_next_open_after_stores_at_the_end(mdir, fs, rng):
    path, tpath = mdir
    data = rng.randbytes(MiB)
    fs.write_bytes(f"{tpath}/f", data)
    assert pread(f"{path}/f", MiB - 8192, 4096) == data[MiB - 8192:MiB - 4096]  # the last window stored
    assert cached_pages(f"{path}/f") == WINDOW // PAGE
    fs.truncate(f"{tpath}/f", 300 * KiB)
    with open(f"{path}/f", "rb") as f:
        assert os.fstat(f.fileno()).st_size == 300 * KiB
        assert f.read() == data[:300 * KiB]


def test_the_page_store_holds_a_bounded_number_of_bytes(monkeypatch):
    """The stores waiting for the store thread are bounded by the bytes they hold as by their count (a
    region store holds 1 MiB): with the thread held up inside the kernel call, submissions fill the queue
    up to QUEUED_BYTES_MAX, and once it goes on every byte and buffer is accounted for again. (The kernel
    call is held by a stand-in here: the queue's accounting is what is tested; the mount tests above store
    into the kernel for real.)"""
    from threefs.client import fuse_store

    go_on = threading.Event()
    monkeypatch.setattr(fuse_store.pyfuse3, "notify_store", lambda ino, offset, data: go_on.wait(30))
    store = fuse_store.PageStore()
    released = []

    class Lease:  # a buffer the loop gives back once its store is done
        def release(self) -> None:
            released.append(self)

    region = memoryview(bytes(MiB))
    n = 0
    while not store.full():
        store.submit(1, [(n * MiB, region)], Lease())
        n += 1
        assert n <= fuse_store.QUEUED_BYTES_MAX // MiB
    assert n == fuse_store.QUEUED_BYTES_MAX // MiB < fuse_store.QUEUED_MAX  # by bytes, not by count
    go_on.set()
    deadline = time.monotonic() + 30
    while store.queued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (store.queued, store.queued_bytes, store.full()) == (0, 0, False)
    store.reclaim()
    assert len(released) == n
