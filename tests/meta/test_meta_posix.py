"""MetaStore answers like Linux: one table of (operation, path, expected errno), run against os.* on a real
local directory and against MetaStore on the same tree. A mismatch with either side fails the test."""

import errno
import os

from meta_helpers import errname, errno_of, run

RD, WR, RW = os.O_RDONLY, os.O_WRONLY, os.O_RDWR
CREAT, EXCL, TRUNC, DIRECTORY = os.O_CREAT, os.O_EXCL, os.O_TRUNC, os.O_DIRECTORY
LONG = "x" * 256

# The tree every case starts from (each case gets its own copy):
#   d/  d/f (5 bytes)  d/sub/  d/sub/g  e/ (empty)
CASES = [
    # stat / lookup
    ("stat", "d/f", 0),
    ("stat", "missing", errno.ENOENT),
    ("stat", "d/missing/x", errno.ENOENT),
    ("stat", "d/f/x", errno.ENOTDIR),
    ("stat", "d/f/", errno.ENOTDIR),
    ("stat", "d/sub/", 0),
    ("stat", "d/sub/../f", 0),
    ("stat", "d//sub/./g", 0),
    ("stat", "d/f/..", errno.ENOTDIR),
    ("stat", f"d/{LONG}", errno.ENAMETOOLONG),
    # mkdir
    ("mkdir", "d/new", 0),
    ("mkdir", "d/new/", 0),
    ("mkdir", "d/f", errno.EEXIST),
    ("mkdir", "d/sub", errno.EEXIST),
    ("mkdir", "missing/new", errno.ENOENT),
    ("mkdir", "d/f/new", errno.ENOTDIR),
    ("mkdir", "d/.", errno.EEXIST),
    ("mkdir", "d/..", errno.EEXIST),
    ("mkdir", f"d/{LONG}", errno.ENAMETOOLONG),
    ("makedirs", "d/x/y/z", 0),
    ("makedirs", "d/sub", 0),
    ("makedirs", "d/f", errno.EEXIST),
    ("makedirs", "d/f/x", errno.ENOTDIR),
    # open
    ("open", "d/f", RD, 0),
    ("open", "d/missing", RD, errno.ENOENT),
    ("open", "d/new", CREAT | WR, 0),
    ("open", "d/f", CREAT | WR, 0),
    ("open", "d/f", CREAT | EXCL | WR, errno.EEXIST),
    ("open", "d/sub", CREAT | EXCL | WR, errno.EEXIST),
    ("open", "d/sub", RD, 0),
    ("open", "d/sub", WR, errno.EISDIR),
    ("open", "d/sub", RW, errno.EISDIR),
    ("open", "d/sub", CREAT | RD, errno.EISDIR),
    ("open", "d/sub", RD | TRUNC, errno.EISDIR),
    ("open", "d/f/", RD, errno.ENOTDIR),
    ("open", "d/new/", CREAT | WR, errno.EISDIR),
    ("open", "d/f/", CREAT | WR, errno.EISDIR),
    ("open", "d/f", RD | DIRECTORY, errno.ENOTDIR),
    ("open", "missing/new", CREAT | WR, errno.ENOENT),
    ("open", "d/f/new", CREAT | WR, errno.ENOTDIR),
    ("open", "d/.", CREAT | WR, errno.EISDIR),
    ("open", "d/f", WR | TRUNC, 0),
    ("open", "d/f", RW | CREAT | TRUNC, 0),
    # unlink
    ("unlink", "d/f", 0),
    ("unlink", "d/sub", errno.EISDIR),
    ("unlink", "d/missing", errno.ENOENT),
    ("unlink", "d/f/", errno.ENOTDIR),
    ("unlink", "d/sub/", errno.EISDIR),
    ("unlink", "d/missing/", errno.ENOENT),
    ("unlink", "d/.", errno.EISDIR),
    ("unlink", "d/..", errno.EISDIR),
    ("unlink", "d/f/x", errno.ENOTDIR),
    # rmdir
    ("rmdir", "e", 0),
    ("rmdir", "e/", 0),
    ("rmdir", "d", errno.ENOTEMPTY),
    ("rmdir", "d/f", errno.ENOTDIR),
    ("rmdir", "missing", errno.ENOENT),
    ("rmdir", "e/.", errno.EINVAL),
    ("rmdir", "d/sub/..", errno.ENOTEMPTY),
    # truncate
    ("truncate", "d/f", 0, 0),
    ("truncate", "d/f", 100, 0),
    ("truncate", "d/sub", 0, errno.EISDIR),
    ("truncate", "d/missing", 0, errno.ENOENT),
    ("truncate", "d/f", -1, errno.EINVAL),
    ("truncate", "d/f/", 0, errno.ENOTDIR),
    # listing
    ("listdir", "d", 0),
    ("listdir", "d/f", errno.ENOTDIR),
    ("listdir", "missing", errno.ENOENT),
    # rename
    ("rename", "d/f", "d/g", 0),
    ("rename", "d/f", "d/sub/g", 0),
    ("rename", "d/f", "d/f", 0),
    ("rename", "d/sub", "d/sub", 0),
    ("rename", "d/sub", "e", 0),
    ("rename", "d/sub/", "d/sub2/", 0),
    ("rename", "d/f", "d/sub", errno.EISDIR),
    ("rename", "d/sub", "d/f", errno.ENOTDIR),
    ("rename", "e", "d", errno.ENOTEMPTY),
    ("rename", "d", "d/sub/x", errno.EINVAL),
    ("rename", "d", "d/sub", errno.EINVAL),
    ("rename", "d/sub/g", "d", errno.ENOTEMPTY),
    ("rename", "d/sub", "d", errno.ENOTEMPTY),
    ("rename", "missing", "d/x", errno.ENOENT),
    ("rename", "d/f", "missing/x", errno.ENOENT),
    ("rename", "d/f/", "d/g", errno.ENOTDIR),
    ("rename", "d/f", "d/g/", errno.ENOTDIR),
    ("rename", "d/.", "x", errno.EBUSY),
    ("rename", "e", "d/..", errno.EBUSY),
    ("rename", "d/f", "d/f/x", errno.ENOTDIR),
    ("rename", "d/sub", "d/sub/g/x", errno.ENOTDIR),
    ("rename", "d/ln", "d/ln2", 0),
    ("rename", "d/ln", "d/sub", errno.EISDIR),
    # symlinks: d/ln -> f
    ("stat", "d/ln", 0),
    ("lstat", "d/ln", 0),
    ("lstat", "d/ln/", errno.ENOTDIR),
    ("open", "d/ln", RD, 0),
    ("open", "d/ln", RD | os.O_NOFOLLOW, errno.ELOOP),
    ("mkdir", "d/ln", errno.EEXIST),
    ("unlink", "d/ln", 0),
    ("symlink", "f", "d/l2", 0),
    ("symlink", "/anything/at/all", "d/l2", 0),
    ("symlink", "x", "d/f", errno.EEXIST),
    ("symlink", "x", "d/sub", errno.EEXIST),
    ("symlink", "x", "d/ln", errno.EEXIST),
    ("symlink", "x", "missing/l", errno.ENOENT),
    ("symlink", "x", "d/f/l", errno.ENOTDIR),
    ("symlink", "", "d/l2", errno.ENOENT),
    ("symlink", "x", "d/new/", errno.ENOENT),
    ("symlink", "x", "d/.", errno.EEXIST),
    ("symlink", "x", f"d/{LONG}", errno.ENAMETOOLONG),
    ("readlink", "d/ln", 0),
    ("readlink", "d/f", errno.EINVAL),
    ("readlink", "d/sub", errno.EINVAL),
    ("readlink", "missing", errno.ENOENT),
    ("readlink", "d/f/x", errno.ENOTDIR),
    # hard links
    ("link", "d/f", "d/h", 0),
    ("link", "d/f", "e/h", 0),
    ("link", "d/ln", "d/h", 0),
    ("link", "d/sub", "d/h", errno.EPERM),
    ("link", "d/f", "d/sub", errno.EEXIST),
    ("link", "d/f", "d/ln", errno.EEXIST),
    ("link", "missing", "d/h", errno.ENOENT),
    ("link", "d/f", "missing/h", errno.ENOENT),
    ("link", "d/f/", "d/h", errno.ENOTDIR),
    ("link", "d/f", "d/h/", errno.ENOENT),
    ("link", "d/f", "d/.", errno.EEXIST),
    # attributes
    ("chmod", "d/f", 0o600, 0),
    ("chmod", "d/sub", 0o700, 0),
    ("chmod", "d/ln", 0o600, 0),
    ("chmod", "missing", 0o600, errno.ENOENT),
    ("chown", "d/f", 1000, 1000, 0),
    ("chown", "d/sub", 1000, -1, 0),
    ("chown", "missing", 1000, 1000, errno.ENOENT),
    ("utime", "d/f", 0),
    ("utime", "d/sub/", 0),
    ("utime", "missing", errno.ENOENT),
]


def build_local(root: str) -> None:
    os.makedirs(f"{root}/d/sub")
    os.mkdir(f"{root}/e")
    with open(f"{root}/d/f", "wb") as f:
        f.write(b"hello")
    open(f"{root}/d/sub/g", "wb").close()
    os.symlink("f", f"{root}/d/ln")


async def build_meta(store, root: str) -> None:
    await store.mkdir(f"{root}/d/sub", parents=True)
    await store.mkdir(f"{root}/e")
    rsp = await store.open(f"{root}/d/f", os.O_CREAT | os.O_WRONLY)
    await store.close(rsp.attr.inode, rsp.session, 5)
    await store.open(f"{root}/d/sub/g", os.O_CREAT | os.O_WRONLY)
    await store.symlink(f"{root}/d/ln", "f")


def join(root: str, rel: str) -> str:
    return f"{root}/{rel}"


def local_call(op: str, root: str, args: tuple) -> None:
    """The operation on the local file system (os.*)."""
    path = join(root, args[0])
    if op == "stat":
        os.stat(path)
    elif op == "lstat":
        os.lstat(path)
    elif op == "mkdir":
        os.mkdir(path)
    elif op == "makedirs":
        os.makedirs(path, exist_ok=True)
    elif op == "open":
        os.close(os.open(path, args[1], 0o644))
    elif op == "unlink":
        os.unlink(path)
    elif op == "rmdir":
        os.rmdir(path)
    elif op == "truncate":
        os.truncate(path, args[1])
    elif op == "listdir":
        os.listdir(path)
    elif op == "rename":
        os.rename(path, join(root, args[1]))
    elif op == "symlink":  # (target, new link)
        os.symlink(args[0], join(root, args[1]))
    elif op == "readlink":
        os.readlink(path)
    elif op == "link":
        os.link(path, join(root, args[1]), follow_symlinks=False)
    elif op == "chmod":
        os.chmod(path, args[1])
    elif op == "chown":
        os.chown(path, args[1], args[2])
    elif op == "utime":
        os.utime(path, None)
    elif op == "utime_at":
        os.utime(path, ns=(args[1], args[1]))
    else:
        raise AssertionError(op)


def local_errno(op: str, root: str, args: tuple) -> int:
    try:
        local_call(op, root, args)
    except OSError as exc:
        return exc.errno
    return 0


def meta_call(store, op: str, root: str, args: tuple, caller=None):
    """The same operation on MetaStore, as `caller` (default: root)."""
    from threefs.meta.ops_attr import Changes
    from threefs.meta.store import Caller
    from threefs.rpc.schemas.meta import UTIME_NOW

    caller = caller or Caller()
    user = caller.user
    path = join(root, args[0])
    simple = {
        "stat": lambda: store.stat(path, user=user),
        "lstat": lambda: store.stat(path, follow=False, user=user),
        "mkdir": lambda: store.mkdir(path, caller=caller),
        "makedirs": lambda: store.mkdir(path, parents=True, caller=caller),
        "open": lambda: store.open(path, args[1], 0o644, caller=caller),
        "unlink": lambda: store.unlink(path, caller=caller),
        "rmdir": lambda: store.rmdir(path, caller=caller),
        "truncate": lambda: store.truncate(path, args[1], user=user),
        "listdir": lambda: store.readdir(path, user=user),
        "rename": lambda: store.rename(path, join(root, args[1]), caller=caller),
        "symlink": lambda: store.symlink(join(root, args[1]), args[0], caller=caller),
        "readlink": lambda: store.readlink(path, user=user),
        "link": lambda: store.link(path, join(root, args[1]), caller=caller),
        "chmod": lambda: store.setattr(path, Changes(mode=args[1]), caller=caller),
        "chown": lambda: store.setattr(path, Changes(uid=None if args[1] == -1 else args[1],
                                                     gid=None if args[2] == -1 else args[2]), caller=caller),
        "utime": lambda: store.setattr(path, Changes(atime_ns=UTIME_NOW, mtime_ns=UTIME_NOW), caller=caller),
        "utime_at": lambda: store.setattr(path, Changes(atime_ns=args[1], mtime_ns=args[1]), caller=caller),
    }
    return simple[op]()


def test_errnos_match_linux(meta, tmp_path):
    async def main():
        mismatches = []
        async with meta.store() as store:
            for i, (op, *args, expected) in enumerate(CASES):
                local_root, meta_root = str(tmp_path / f"case{i}"), f"/case{i}"
                build_local(local_root)
                await build_meta(store, meta_root)
                got_local = local_errno(op, local_root, tuple(args))
                got_meta = await errno_of(meta_call(store, op, meta_root, tuple(args)))
                if not got_local == got_meta == expected:
                    mismatches.append(f"{op}{tuple(args)}: expected {errname(expected)}, "
                                      f"linux {errname(got_local)}, meta {errname(got_meta)}")
        assert not mismatches, "\n".join(mismatches)

    run(main())


def test_tree_after_linux_ops_matches(meta, tmp_path):
    """Successful mutations leave the same tree in both (names and types, recursively)."""

    def local_tree(root):
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel = os.path.relpath(dirpath, root)
            out += [(os.path.normpath(f"{rel}/{n}"), "d") for n in dirnames]
            out += [(os.path.normpath(f"{rel}/{n}"), "l" if os.path.islink(f"{dirpath}/{n}") else "f")
                    for n in filenames]
        return sorted(out)

    async def meta_tree(store, root, rel="."):
        out = []
        entries, more = await store.readdir(f"{root}/{rel}" if rel != "." else root)
        assert not more
        for e in entries:
            name = os.path.normpath(f"{rel}/{e.name}")
            out.append((name, {2: "d", 3: "l"}.get(e.type, "f")))
            if e.type == 2:
                out += await meta_tree(store, root, name)
        return sorted(out)

    async def main():
        async with meta.store() as store:
            for i, (op, *args, expected) in enumerate(CASES):
                if expected != 0:
                    continue
                local_root, meta_root = str(tmp_path / f"t{i}"), f"/t{i}"
                build_local(local_root)
                await build_meta(store, meta_root)
                local_errno(op, local_root, tuple(args))
                await errno_of(meta_call(store, op, meta_root, tuple(args)))
                assert local_tree(local_root) == await meta_tree(store, meta_root), (op, args)

    run(main())
