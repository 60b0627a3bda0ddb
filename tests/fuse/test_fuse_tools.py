"""Standard tools on a real FUSE mount: cp, dd, sha256sum, ls -l, mv, rm -r, ln -s, chmod, tar,
concurrent writers; and the same files seen through the Python client."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

MiB = 1 << 20


def sh(cmd: str, cwd: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=120)
    if check and r.returncode:
        raise AssertionError(f"{cmd!r} exited {r.returncode}: {r.stderr.strip()}")
    return r


def sha(path: str) -> str:
    return sh(f"sha256sum '{path}'").stdout.split()[0]


def test_cp_sha256_and_python_client_sees_it(mdir, fs, tmp_path, rng):
    local = tmp_path / "r.bin"
    local.write_bytes(rng.randbytes(5 * MiB + 4321))
    path, tpath = mdir
    sh(f"cp '{local}' '{path}/r.bin'")
    assert sha(f"{path}/r.bin") == sha(str(local))
    assert fs.stat(f"{tpath}/r.bin").length == local.stat().st_size  # published at close(2)
    assert fs.read_bytes(f"{tpath}/r.bin") == local.read_bytes()
    fs.write_bytes(f"{tpath}/from-client", b"written by the client\n")
    assert open(f"{path}/from-client").read() == "written by the client\n"


def test_dd_overwrite_truncate_append(mdir, rng):
    path, _ = mdir
    f = f"{path}/dd.bin"
    sh(f"dd if=/dev/urandom of={f} bs=1M count=3 status=none")
    model = bytearray(open(f, "rb").read())
    assert len(model) == 3 * MiB
    patch = rng.randbytes(5000)
    with open("/dev/shm/threefs-patch", "wb") as p:
        p.write(patch)
    try:  # overwrite across the chunk boundary, keep the rest
        sh(f"dd if=/dev/shm/threefs-patch of={f} bs=1 seek={MiB - 2500} conv=notrunc status=none")
    finally:
        os.unlink("/dev/shm/threefs-patch")
    model[MiB - 2500:MiB + 2500] = patch
    assert open(f, "rb").read() == bytes(model)
    sh(f"truncate -s 1234567 {f}")
    assert os.path.getsize(f) == 1234567
    sh(f"echo tail >> {f}")
    assert open(f, "rb").read() == bytes(model[:1234567]) + b"tail\n"
    sh(f"dd if={f} of={f}.direct bs=1M iflag=direct oflag=direct status=none")
    assert sha(f"{f}.direct") == sha(f)


def test_ls_mkdir_mv_rm(mdir):
    path, _ = mdir
    sh(f"mkdir -p {path}/a/b/c && echo hi > {path}/a/b/c/f && printf 12345 > {path}/a/g")
    out = sh(f"ls -l {path}/a").stdout
    assert any(line.startswith("d") and line.endswith(" b") for line in out.splitlines())
    assert any(line.startswith("-") and " 5 " in line and line.endswith(" g") for line in out.splitlines())
    sh(f"mv {path}/a/b {path}/moved")
    assert open(f"{path}/moved/c/f").read() == "hi\n"
    assert not os.path.exists(f"{path}/a/b")
    r = sh(f"rmdir {path}/moved", check=False)
    assert r.returncode and "not empty" in r.stderr.lower()
    r = sh(f"mkdir {path}/a", check=False)
    assert r.returncode and "exists" in r.stderr.lower()
    r = sh(f"cat {path}/none", check=False)
    assert r.returncode and "No such file" in r.stderr
    sh(f"rm -r {path}/moved {path}/a")
    assert os.listdir(path) == []


def test_tar_round_trip(mdir, fs, tmp_path, rng):
    """tar as root keeps modes, owners, times and symlinks: all of them must survive the mount."""
    src = tmp_path / "src"
    for rel, size in (("x/one.bin", 2 * MiB + 1), ("x/y/two.txt", 100), ("three", 0), ("x/y/z/four", 70_000)):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(rng.randbytes(size))
    os.chmod(src / "x/y/two.txt", 0o640)
    os.chown(src / "x/one.bin", 1234, 2345)
    os.symlink("y/two.txt", src / "x/link")
    os.utime(src / "three", ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    os.utime(src / "x/one.bin", ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))
    path, fspath = mdir
    os.mkdir(f"{path}/t")
    sh(f"tar -C {src} -cf - . | tar -C {path}/t -xpf -")
    st = os.stat(f"{path}/t/x/one.bin")
    assert (st.st_uid, st.st_gid) == (1234, 2345)
    assert os.stat(f"{path}/t/x/y/two.txt").st_mode & 0o777 == 0o640
    assert os.stat(f"{path}/t/three").st_mtime_ns == 1_600_000_000_000_000_000
    # tar sets a file's times on its open descriptor after writing it, before closing it: publishing the
    # writes at the close must not move the time it set (meta's own record, not the kernel's cache)
    for rel in ("x/one.bin", "x/y/z/four", "three"):  # tar keeps whole seconds
        assert fs.stat(f"{fspath}/t/{rel}").mtime_ns == (src / rel).stat().st_mtime_ns // 10**9 * 10**9, rel
    assert os.readlink(f"{path}/t/x/link") == "y/two.txt"
    sh(f"tar -C {path}/t -cf {tmp_path}/back.tar .")
    os.mkdir(tmp_path / "back")
    sh(f"tar -C {tmp_path}/back -xpf {tmp_path}/back.tar")
    sh(f"diff -r --no-dereference {src} {tmp_path}/back")
    listing = sorted(sh(f"cd {src} && find . -printf '%p %m %U %G %s %y\\n'").stdout.splitlines())
    assert sorted(sh(f"cd {tmp_path}/back && find . -printf '%p %m %U %G %s %y\\n'").stdout.splitlines()) \
        == listing


def test_concurrent_writers_to_different_files(mdir):
    path, _ = mdir
    procs = [subprocess.Popen(f"dd if=/dev/urandom of={path}/w{i} bs=256k count=24 status=none",
                              shell=True) for i in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 4
    for i in range(4):
        assert os.path.getsize(f"{path}/w{i}") == 6 * MiB
    data = [open(f"{path}/w{i}", "rb").read() for i in range(4)]
    assert len({hashlib.sha256(x).digest() for x in data}) == 4


def test_symlink_and_hard_link(mdir):
    path, _ = mdir
    sh(f"echo target > {path}/t && ln -s t {path}/l && ln {path}/t {path}/h")
    assert os.readlink(f"{path}/l") == "t" and open(f"{path}/l").read() == "target\n"
    assert sh(f"ls -l {path}/l").stdout.startswith("l")
    assert os.stat(f"{path}/t").st_nlink == 2 and os.stat(f"{path}/h").st_ino == os.stat(f"{path}/t").st_ino
    os.unlink(f"{path}/t")
    assert open(f"{path}/h").read() == "target\n" and os.stat(f"{path}/h").st_nlink == 1
    r = sh(f"cat {path}/l", check=False)
    assert r.returncode and "No such file" in r.stderr  # dangling now


def test_chmod_chown_touch(mdir):
    path, _ = mdir
    sh(f"touch {path}/f && chmod 600 {path}/f && chown 77:88 {path}/f")
    assert sh(f"stat -c '%a %u %g' {path}/f").stdout.split() == ["600", "77", "88"]
    sh(f"touch -d '2020-01-02 03:04:05 UTC' {path}/f")
    assert os.stat(f"{path}/f").st_mtime == 1577934245


def test_other_users_get_their_ids_and_their_permissions(mdir, fs):
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    path, tpath = mdir
    as_user = "setpriv --reuid=1000 --regid=1000 --clear-groups"
    sh(f"chmod 777 {path} && echo secret > {path}/private && chmod 600 {path}/private")
    sh(f"{as_user} sh -c 'echo mine > {path}/theirs'")
    attr = fs.stat(f"{tpath}/theirs")
    assert (attr.uid, attr.gid) == (1000, 1000)  # created as the calling process
    r = sh(f"{as_user} cat {path}/private", check=False)
    assert r.returncode and "Permission denied" in r.stderr


def test_df_on_the_mount(mount):
    mnt, _ = mount
    out = sh(f"df -P {mnt}").stdout.splitlines()[-1]
    assert out.startswith("threefs")


def test_reads_sequential_random_and_concurrent_match(mdir, fs, rng):
    """The daemon's read-ahead and the kernel's: every pattern returns the file's bytes."""
    path, tpath = mdir
    data = rng.randbytes(9 * MiB + 777)
    fs.write_bytes(f"{tpath}/data", data)
    f = f"{path}/data"
    for bs in ("4k", "1M", "3M"):
        sh(f"dd if={f} of={f}.copy-{bs} bs={bs} status=none")
        assert open(f"{f}.copy-{bs}", "rb").read() == data
    fd = os.open(f, os.O_RDONLY)
    try:
        for _ in range(300):
            off = rng.randrange(0, len(data) + 10)
            n = rng.choice((1, 4096, 65536, MiB + 3))
            assert os.pread(fd, n, off) == data[off:off + n]
    finally:
        os.close(fd)
    readers = [subprocess.Popen(f"sha256sum {f}", shell=True, stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    want = hashlib.sha256(data).hexdigest()
    assert all(p.communicate(timeout=60)[0].split()[0] == want for p in readers)


def test_read_sees_writes_of_another_handle(mdir, rng):
    path, _ = mdir
    f = f"{path}/rw"
    data = bytearray(rng.randbytes(3 * MiB))
    with open(f, "wb") as w:
        w.write(data)
    with open(f, "rb", buffering=0) as r, open(f, "r+b", buffering=0) as w:
        assert r.read(MiB) == data[:MiB]  # starts a sequential stream: the daemon prefetches ahead
        w.seek(MiB + 100)
        w.write(b"new bytes")
        data[MiB + 100:MiB + 109] = b"new bytes"
        os.posix_fadvise(r.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # not from the page cache
        assert r.read(2 * MiB) == data[MiB:]


def test_times_set_on_an_open_file_outlast_its_close(mdir, fs):
    """futimens after write(2), before close (tar, cp -p): the writes are published before the time is set,
    so neither the close nor a later stat moves it; writes after it move it again."""
    path, fspath = mdir
    set_ns = 1_400_000_000_123_456_789
    with open(f"{path}/f", "wb") as f:
        f.write(b"x" * 100_000)
        f.flush()
        os.utime(f.fileno(), ns=(set_ns, set_ns))
    assert fs.stat(f"{fspath}/f").mtime_ns == set_ns
    assert os.stat(f"{path}/f").st_mtime_ns == set_ns
    assert fs.stat(f"{fspath}/f").length == 100_000
    with open(f"{path}/g", "wb") as f:
        f.write(b"y" * 10)
        f.flush()
        os.utime(f.fileno(), ns=(set_ns, set_ns))
        f.write(b"z" * 10)  # a write after the time was set moves it, as on any file system
    assert fs.stat(f"{fspath}/g").mtime_ns > set_ns
    assert open(f"{path}/g", "rb").read() == b"y" * 10 + b"z" * 10
