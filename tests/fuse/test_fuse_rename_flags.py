"""renameat2 flags on the mount: RENAME_NOREPLACE works; RENAME_EXCHANGE and RENAME_WHITEOUT, which meta
cannot do, fail with EINVAL and change nothing (a whiteout rename used to move the file and leave no
whiteout device behind, as if the flag were not there)."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4
AT_FDCWD = -100

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="RENAME_WHITEOUT needs CAP_MKNOD")


def renameat2(old: str, new: str, flags: int) -> int:
    """0, or the errno of renameat2(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) == 0:
        return 0
    return ctypes.get_errno()


def write(path: str, data: str) -> None:
    with open(path, "w") as f:
        f.write(data)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_noreplace_renames_only_onto_a_free_name(mdir):
    path, _ = mdir
    a, b, c = (os.path.join(path, n) for n in "abc")
    write(a, "A")
    write(b, "B")
    assert renameat2(a, b, RENAME_NOREPLACE) == errno.EEXIST
    assert (read(a), read(b)) == ("A", "B")
    assert renameat2(a, c, RENAME_NOREPLACE) == 0
    assert not os.path.exists(a) and read(c) == "A"


@pytest.mark.parametrize("flag", [RENAME_EXCHANGE, RENAME_WHITEOUT])
def test_exchange_and_whiteout_fail_and_change_nothing(mdir, flag):
    path, _ = mdir
    a, b, w = (os.path.join(path, f"{n}{flag}") for n in "abw")
    write(a, "A")
    write(b, "B")
    assert renameat2(a, b, flag) == errno.EINVAL
    # an exchange with a missing name is the kernel's ENOENT (as on ext4); a whiteout is ours to refuse
    assert renameat2(a, w, flag) == (errno.ENOENT if flag == RENAME_EXCHANGE else errno.EINVAL)
    assert (read(a), read(b)) == ("A", "B")
    assert not os.path.lexists(w)
