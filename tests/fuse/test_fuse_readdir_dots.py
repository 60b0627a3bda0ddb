"""A directory listing on the mount has '.' and '..' (as on ext4), each once, with the inode numbers of
the directory and of its parent, and every other entry once, also names that sort before '.'."""

from __future__ import annotations

import os
import subprocess

import pytest


def listing(path: str) -> list[tuple[int, str]]:
    """(inode, name) of every entry `ls -a` prints, in order (-f: unsorted, as readdir returns them)."""
    out = subprocess.run(["ls", "-a", "-f", "-i", "-1", path], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    rows = []
    for line in out.splitlines():
        ino, name = line.strip().split(" ", 1)
        rows.append((int(ino), name))
    return rows


def test_listing_has_dot_and_dotdot_with_their_inodes(mdir):
    path, _ = mdir
    sub = os.path.join(path, "sub")
    os.mkdir(sub)
    for name in ("!first", "+plus", "-dash", "a", "z"):  # '!', '+', '-' sort before '.'
        open(os.path.join(sub, name), "w").close()
    rows = listing(sub)
    names = [n for _, n in rows]
    assert sorted(names) == sorted([".", "..", "!first", "+plus", "-dash", "a", "z"])
    by_name = dict((n, i) for i, n in rows)
    assert by_name["."] == os.stat(sub).st_ino
    assert by_name[".."] == os.stat(path).st_ino
    assert by_name["a"] == os.stat(os.path.join(sub, "a")).st_ino


def test_empty_directory_and_the_mount_root_list_the_dots(mount, mdir):
    path, _ = mdir
    empty = os.path.join(path, "empty")
    os.mkdir(empty)
    assert sorted(n for _, n in listing(empty)) == [".", ".."]
    assert os.listdir(empty) == []  # Python drops the dots itself: still empty
    mnt, _ = mount
    root = dict((n, i) for i, n in listing(mnt))
    assert root["."] == os.stat(mnt).st_ino and ".." in root  # ls shows the mount point's own '..'


@pytest.mark.parametrize("count", [1100])  # more than one meta readdir page (1024 entries)
def test_a_listing_of_several_pages_has_each_name_once(mdir, count):
    path, _ = mdir
    big = os.path.join(path, "big")
    os.mkdir(big)
    want = [f"f{i:05d}" for i in range(count)]
    for name in want:
        os.close(os.open(os.path.join(big, name), os.O_CREAT | os.O_WRONLY, 0o644))
    names = [n for _, n in listing(big)]
    assert len(names) == len(set(names)) == count + 2
    assert sorted(names) == sorted(want + [".", ".."])
