"""POSIX conformance of the mount, differentially: every case runs the same system calls on a local
directory (ext4 here) and on the mount, each call in a forked child as root or as an unprivileged user
with supplementary groups, and every outcome must be the same (posix_diff.py: return value or errno,
which files' mtime/ctime moved, and the final tree: type, mode, uid, gid, nlink, size, rdev, xattrs,
content).

Generated sequences (seeded) cover every call kind in posix_diff.OP_KINDS; the named cases below keep
one sequence per cause listed in issue 17, so that each stays fixed. A failing generated sequence is
shrunk to the shortest one that still differs, which the failure message prints for pasting here.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

import pytest
from posix_diff import Differ, generate

SEQUENCES = 64  # generated sequences per run, in CHUNKS parametrised tests (posix_diff.py runs more)
CHUNKS = 4

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users in the children needs root")


@pytest.fixture(scope="module")
def differ(mount):
    """A Differ between a local directory and a directory on the mount (both world-searchable)."""
    mnt, _ = mount
    ref = tempfile.mkdtemp(prefix="threefs-posix-ref-")
    os.chmod(ref, 0o755)
    mdir = os.path.join(mnt, f"posix-{os.getpid()}")
    os.mkdir(mdir)
    os.chmod(mdir, 0o755)
    differ = Differ(ref, mdir)
    yield differ
    differ.close()
    shutil.rmtree(ref)
    shutil.rmtree(mdir)


def check(differ: Differ, ops: list[list]) -> None:
    diffs = differ.diff(ops)
    if diffs:
        small = differ.shrink(ops)
        raise AssertionError("the mount and the local directory differ; shortest sequence that still "
                             f"differs:\n{json.dumps(small)}\n" + "\n".join(differ.diff(small)))


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_generated_sequences_match_the_local_file_system(differ, chunk):
    per = SEQUENCES // CHUNKS
    for seed in range(chunk * per, (chunk + 1) * per):
        check(differ, generate(random.Random(seed)))


CASES = {
    # 1. special files: created with their type, mode and rdev, then used like any file
    "special_files": [
        ["root", "mknod", "pub/a", "chr", 0o620, 0x0103], ["root", "mknod", "pub/b", "blk", 0o640, 0x0801],
        ["u", "mkfifo", "pub/s", 0o640], ["u", "sock", "own/a"], ["u", "mknod", "pub/d2", "chr", 0o644, 1],
        ["root", "stat", "pub/a"], ["u", "rename", "pub/s", "own/b"], ["u", "link", "own/b", "own/s"],
        ["u", "chmod", "own/s", 0o600], ["root", "chown", "pub/a", "u", "gs"], ["u", "unlink", "own/b"],
        ["root", "open", "own/a", "r"], ["root", "rename", "pub/b", "grp/b"], ["u", "unlink", "own/s"],
    ],
    # 2. permissions as the kernel sees them: a directory writable through a supplementary group
    "supplementary_group_directory": [
        ["u", "mkdir", "grp/a", 0o775], ["u", "creat", "grp/b", 0o664], ["u", "rename", "grp/b", "grp/s"],
        ["u", "chmod", "grp/s", 0o600],
        ["u", "unlink", "grp/s"], ["u", "rmdir", "grp/a"], ["o", "creat", "grp/b", 0o644],
        ["u", "write", "grp/f", 0, 10], ["u", "truncate", "grp/f", 3], ["u", "utime_now", "grp/f"],
        ["u", "creat", "sgd/a", 0o2755], ["u", "mkdir", "sgd/b", 0o755], ["o", "creat", "sgd/s", 0o2775],
    ],
    # 3. errnos: chown by a non-owner is EPERM; chmod g+s by a non-member clears the bit
    "chown_chmod_errnos": [
        ["o", "chown", "pub/f", "o", "keep"], ["o", "lchown", "pub/l", "keep", "go"],
        ["u", "chown", "pub/f", "keep", "gs"], ["u", "chown", "pub/f", "keep", "go"],
        ["u", "chmod", "pub/f", 0o2755], ["u", "chown", "pub/f", "u", "gu"], ["u", "chmod", "pub/f", 0o2755],
        ["o", "chmod", "stk/f", 0o4755], ["o", "chown", "stk/f", "keep", "gs"],
        ["root", "chown", "stk/f", "keep", "gs"], ["root", "chmod", "stk/f", 0o6755],
        ["o", "chown", "stk/f", "keep", "go"],
    ],
    # 4. descriptor semantics: ftruncate follows how the fd was opened, not the mode bits now
    "descriptor_semantics": [
        ["u", "ftruncate", "pub/f", "r", 0], ["u", "ftruncate", "pub/f", "w", 2],
        ["u", "creat0_ftruncate", "pub/a"], ["u", "creat0_ftruncate", "grp/a"],
        ["u", "fchmod_write", "own/f"], ["u", "read", "own/f"], ["root", "read", "own/f"],
        ["u", "open", "own/f", "w"],
    ],
    # 5. extended attributes: namespaces, flags, limits, who may set what
    "xattrs": [
        ["u", "setxattr", "pub/f", "user.a", "v", 0], ["u", "setxattr", "pub/f", "user.a", "w", 1],
        ["u", "setxattr", "pub/f", "user.b", "v", 2], ["u", "setxattr", "pub/f", "user.a", "x" * 300, 2],
        ["u", "getxattr", "pub/f", "user.a"], ["u", "listxattr", "pub/f"],
        ["o", "getxattr", "pub/f", "user.a"],
        ["o", "setxattr", "pub/f", "user.b", "v", 0], ["u", "setxattr", "pub/f", "trusted.t", "v", 0],
        ["root", "setxattr", "pub/f", "trusted.t", "v", 0], ["u", "listxattr", "pub/f"],
        ["root", "listxattr", "pub/f"], ["u", "setxattr", "pub/f", "os2.x", "v", 0],
        ["u", "setxattr", "pub/f", "user.", "v", 0], ["u", "setxattr", "pub/f", "user." + "n" * 251, "v", 0],
        ["u", "setxattr", "pub/l", "user.a", "v", 0], ["u", "mkfifo", "pub/s", 0o666],
        ["u", "setxattr", "pub/s", "user.a", "v", 0], ["u", "getxattr", "pub/s", "user.a"],
        ["o", "setxattr", "stk", "user.a", "v", 0], ["root", "setxattr", "stk", "user.a", "v", 0],
        ["u", "removexattr", "pub/f", "user.a"], ["u", "removexattr", "pub/f", "user.a"],
        ["root", "setxattr", "pub/d", "security.s", "v", 0], ["u", "rename", "pub/f", "pub/b"],
        ["u", "getxattr", "pub/b", "user.b"],
    ],
    # 6. fallocate: reserve and extend, keep size, punch a hole
    "fallocate": [
        ["u", "fallocate", "pub/f", 0, 3, 9000], ["u", "fallocate", "pub/f", 1, 0, 20000],
        ["u", "write", "pub/f", 4096, 10], ["u", "fallocate", "pub/f", 3, 4090, 9],
        ["u", "read", "pub/f"], ["o", "fallocate", "pub/f", 0, 0, 5], ["u", "fallocate", "pub/f", 2, 0, 5],
    ],
    # 7. times: ctime on every metadata change, mtime+ctime on content and on the directory's entries
    "times": [
        ["u", "chmod", "pub/f", 0o640], ["u", "link", "pub/f", "pub/a"], ["u", "unlink", "pub/a"],
        ["u", "rename", "pub/f", "pub/b"], ["u", "rename", "pub/b", "own/b"], ["u", "truncate", "own/b", 1],
        ["u", "setxattr", "own/b", "user.a", "v", 0], ["u", "removexattr", "own/b", "user.a"],
        ["root", "chown", "own/b", "o", "go"], ["u", "utime_now", "pub"], ["o", "write", "own/b", 0, 1],
        ["u", "mkdir", "pub/a", 0o755], ["u", "rename", "pub/a", "pub/d/a"], ["u", "rmdir", "pub/d/a"],
    ],
    # shrunk from generated seed 1090: chown(-1, -1) moves only ctime (the kernel sends FATTR_CTIME alone)
    "chown_nothing_moves_ctime": [
        ["u", "mkfifo", "pub/a", 0o640], ["u", "lchown", "pub/a", "keep", "keep"],
        ["u", "chown", "pub/f", "keep", "keep"], ["o", "chown", "stk/f", "keep", "keep"],
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_issue_cases_match_the_local_file_system(differ, case):
    check(differ, CASES[case])
