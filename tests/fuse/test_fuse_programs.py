"""Everyday programs on the mount, with what issue 17 added: a FIFO with a reader and a writer, rsync -aHAX,
cp -a --preserve=all and tar --xattrs (hard links, special files, extended attributes survive), git,
sqlite3 (WAL) and python -m venv. Each compares what the program left on the mount with the same on a
local directory where that is meaningful."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest


def sh(cmd: str, cwd: str | None = None) -> str:
    r = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=180)
    if r.returncode:
        raise AssertionError(f"{cmd!r} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def need(tool: str) -> None:
    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed (scripts/setup-system.sh installs it)")


def make_tree(top: str) -> None:
    """Files with xattrs, a hard link, a symlink, a FIFO, a socket-free special set, odd modes."""
    os.makedirs(f"{top}/sub")
    with open(f"{top}/a", "wb") as f:
        f.write(os.urandom(70_000))
    os.setxattr(f"{top}/a", "user.origin", b"local")
    os.setxattr(f"{top}/sub", "user.dir", b"yes")
    os.link(f"{top}/a", f"{top}/sub/a-link")
    os.symlink("../a", f"{top}/sub/sym")
    os.mkfifo(f"{top}/fifo", 0o640)
    os.mknod(f"{top}/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with open(f"{top}/setgid", "w") as f:
        f.write("x")
    os.chmod(f"{top}/setgid", 0o2750)
    os.chown(f"{top}/setgid", 20001, 20100)


def describe(top: str) -> dict:
    out = {}
    for root, dirs, files in os.walk(top):
        for name in sorted(dirs + files):
            p = os.path.join(root, name)
            s = os.lstat(p)
            rel = os.path.relpath(p, top)
            xattrs = {n: os.getxattr(p, n, follow_symlinks=False)
                      for n in sorted(os.listxattr(p, follow_symlinks=False)) if n.startswith("user.")}
            entry = (stat.filemode(s.st_mode), s.st_uid, s.st_gid, s.st_rdev, xattrs)
            if stat.S_ISREG(s.st_mode):
                entry += (s.st_nlink, open(p, "rb").read())
            elif stat.S_ISLNK(s.st_mode):
                entry += (os.readlink(p),)
            out[rel] = entry
    return out


def test_fifo_carries_data_between_a_writer_and_a_reader(mdir):
    path, _ = mdir
    fifo = f"{path}/pipe"
    os.mkfifo(fifo, 0o600)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    payload = os.urandom(300_000)  # more than a pipe buffer: both sides must run at once
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    with open(fifo, "wb") as w:
        w.write(payload)
    reader.join(timeout=60)
    assert not reader.is_alive() and got == [payload]
    out = sh(f"sh -c 'echo through-the-mount > {fifo} & cat {fifo}; wait'")
    assert out == "through-the-mount\n"


def test_rsync_aHAX_round_trip_keeps_everything(mdir, tmp_path):
    need("rsync")
    path, _ = mdir
    src = str(tmp_path / "src")
    make_tree(src)
    sh(f"rsync -aHAX {src}/ {path}/copy/")
    assert describe(f"{path}/copy") == describe(src)
    sh(f"rsync -aHAX {path}/copy/ {tmp_path}/back/")
    assert describe(str(tmp_path / "back")) == describe(src)


def test_cp_a_preserve_all_and_tar_xattrs(mdir, tmp_path):
    path, _ = mdir
    src = str(tmp_path / "src")
    make_tree(src)
    sh(f"cp -a --preserve=all {src} {path}/cp")
    assert describe(f"{path}/cp") == describe(src)
    sh(f"tar --xattrs --xattrs-include='user.*' -cf {tmp_path}/t.tar -C {src} .")
    os.mkdir(f"{path}/untar")
    sh(f"tar --xattrs --xattrs-include='user.*' -xf {tmp_path}/t.tar -C {path}/untar")
    assert describe(f"{path}/untar") == describe(src)


def test_git_sqlite_wal_and_venv(mdir):
    need("git")
    need("sqlite3")
    path, _ = mdir
    repo = f"{path}/repo"
    os.mkdir(repo)
    git = "git -c user.email=t@example.com -c user.name=t -c init.defaultBranch=main"
    sh(f"{git} init -q && echo one > f && {git} add f && {git} commit -qm one && echo two >> f && "
       f"{git} commit -qam two && {git} fsck --strict && {git} status --porcelain", cwd=repo)
    assert sh("git log --format=%s", cwd=repo).split() == ["two", "one"]
    db = f"{path}/db.sqlite"
    sh(f"sqlite3 {db} 'PRAGMA journal_mode=WAL; CREATE TABLE t(x); WITH RECURSIVE c(x) AS (SELECT 1 "
       "UNION ALL SELECT x + 1 FROM c WHERE x < 2000) INSERT INTO t SELECT x FROM c;'")
    assert sh(f"sqlite3 {db} 'PRAGMA integrity_check; SELECT count(*), sum(x) FROM t;'").split() == \
        ["ok", "2000|2001000"]
    sh(f"{sys.executable} -m venv --without-pip {path}/venv")
    assert sh(f"{path}/venv/bin/python -c 'import sys; print(sys.prefix)'").strip() == f"{path}/venv"
