"""A differential POSIX conformance engine: the same scripted system-call sequences run on a local
directory (ext4 here) and on the threefs mount, each call in a forked child holding the credentials of
its actor (root, or an unprivileged user with supplementary groups), and every outcome is compared:
the return value or errno of each call, whether it moved the mtime/ctime of the file and its directory,
and at the end the tree itself (type, mode, uid, gid, nlink, size, rdev, extended attributes, content).

    python tests/fuse/posix_diff.py --seeds 300      # pass rate of 300 generated sequences on a fresh
                                                     # cluster + mount against a local directory

Sequences come from `generate(random.Random(seed))`; a failing one is shrunk (`shrink`) to the shortest
sub-sequence that still differs, which is what a regression test should keep.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import random
import shutil
import socket
import stat
import sys
import time

# Identities (no /etc/passwd entries needed). U is in group S only through its supplementary groups.
UID_U, GID_U, UID_O, GID_O, GID_S = 20001, 20001, 20002, 20002, 20100
ACTORS = {"root": (0, 0, ()), "u": (UID_U, GID_U, (GID_S,)), "o": (UID_O, GID_O, ())}
IDS = {"root": 0, "u": UID_U, "o": UID_O, "gu": GID_U, "go": GID_O, "gs": GID_S, "keep": -1}

# The starting tree: directories that exercise every permission path, a file in each.
DIRS = {  # name: (mode, uid, gid)
    "pub": (0o777, 0, 0),
    "grp": (0o770, 0, GID_S),  # writable for U only through the supplementary group
    "own": (0o755, UID_U, GID_U),
    "stk": (0o1777, 0, 0),
    "sgd": (0o2777, 0, GID_S),
    "ro": (0o555, 0, 0),
}
FILES = {  # path: (mode, uid, gid)
    "pub/f": (0o644, UID_U, GID_U),
    "grp/f": (0o660, 0, GID_S),
    "own/f": (0o600, UID_U, GID_U),
    "stk/f": (0o666, UID_O, GID_O),
    "sgd/f": (0o664, UID_O, GID_S),
    "ro/f": (0o644, 0, 0),
}
SUBDIRS = {"pub/d": (0o755, UID_U, GID_U), "stk/d": (0o777, UID_O, GID_O), "sgd/d": (0o2775, 0, GID_S)}
SYMLINKS = {"pub/l": "f", "grp/l": "../pub/f"}
NAMES = ["f", "f", "f", "a", "b", "s", "d", "l"]
TIME_SLEEP_S = 0.006  # > the kernel's coarse clock tick, so "did the time move" is observable on ext4
XATTR_NAMES = ["user.a", "user.b", "trusted.t", "security.s", "user." + "n" * 250, "os2.x", "user."]
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


# -- generating sequences ---------------------------------------------------------------------------------


def _path(r: random.Random, used: list[str]) -> str:
    """A path of the tree, often one an earlier call of the sequence named (it may exist by now)."""
    if used and r.random() < 0.4:
        return r.choice(used)
    d = r.choice(list(DIRS) + ["pub", "grp"])
    p = f"{d}/{r.choice(NAMES)}" if r.random() < 0.9 else d
    used.append(p)
    return p


def _mode(r: random.Random) -> int:
    return r.choice([0o644, 0o600, 0o000, 0o777, 0o2755, 0o4755, 0o1777, 0o2644, 0o640, 0o751])


def generate(r: random.Random, length_max: int = 10) -> list[list]:
    """A sequence of [actor, op, *args] (JSON-able, so a failing one pastes into a regression test)."""
    ops, used = [], []
    for _ in range(r.randint(1, length_max)):
        actor = r.choice(["root", "u", "u", "o"])
        p, q = _path(r, used), _path(r, used)
        kind = r.choice(OP_KINDS)
        args = {
            "creat": [p, _mode(r)], "mkdir": [p, _mode(r)], "rmdir": [p], "unlink": [p],
            "rename": [p, q], "link": [p, q], "symlink": ["target", p],
            "mknod": [p, r.choice(["fifo", "chr", "blk", "reg"]), _mode(r), r.choice([0, 0x0103, 0x0801])],
            "mkfifo": [p, _mode(r)], "sock": [p], "chmod": [p, _mode(r)],
            "chown": [p, r.choice(list(IDS)[:3] + ["keep"]), r.choice(list(IDS)[3:])],
            "lchown": [p, r.choice(list(IDS)[:3] + ["keep"]), r.choice(list(IDS)[3:])],
            "truncate": [p, r.choice([0, 3, 5000])],
            "ftruncate": [p, r.choice(["r", "w", "rw"]), r.choice([0, 7])],
            "creat0_ftruncate": [p], "fchmod_write": [p], "open": [p, r.choice(["r", "w", "rw", "wt", "ra"])],
            "write": [p, r.choice([0, 2, 4096]), r.choice([1, 10])], "read": [p],
            "utime_now": [p], "utime_set": [p], "access": [p, r.choice([os.R_OK, os.W_OK, os.X_OK, os.F_OK])],
            "setxattr": [p, r.choice(XATTR_NAMES), r.choice(["v", "", "x" * 300]), r.choice([0, 1, 2])],
            "getxattr": [p, r.choice(XATTR_NAMES)], "listxattr": [p],
            "removexattr": [p, r.choice(XATTR_NAMES)],
            "fallocate": [p, r.choice([0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE]),
                          r.choice([0, 3]), r.choice([5, 9000])],
            "stat": [p],
        }[kind]
        ops.append([actor, kind, *args])
    return ops


# -- running one call -----------------------------------------------------------------------------------


def _open_flags(how: str) -> int:
    return {"r": os.O_RDONLY, "w": os.O_WRONLY, "rw": os.O_RDWR, "wt": os.O_WRONLY | os.O_TRUNC,
            "ra": os.O_RDWR | os.O_APPEND}[how]


def _with_fd(path: str, flags: int, fn, mode: int = 0o644):
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    try:
        return fn(fd)
    finally:
        os.close(fd)


def _mknod(p: str, kind: str, mode: int, rdev: int):
    bits = {"fifo": stat.S_IFIFO, "chr": stat.S_IFCHR, "blk": stat.S_IFBLK, "reg": stat.S_IFREG}[kind]
    os.mknod(p, bits | mode, rdev)


def _sock(p: str):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(p)
    finally:
        s.close()


def _fallocate(p: str, mode: int, off: int, length: int):
    def go(fd):
        if _libc.fallocate(fd, mode, off, length) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    _with_fd(p, os.O_RDWR, go)


def _xattr_value(v: str) -> bytes:
    return v.encode()


def _list_xattrs(p: str) -> list:
    return sorted(os.listxattr(p, follow_symlinks=False))


def _call(kind: str, args: list):
    """One operation; its return value, reduced to what both file systems must agree on."""
    p = args[0] if args else None
    if kind == "creat":
        return os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, args[1]))
    if kind == "open":
        return _with_fd(p, _open_flags(args[1]), lambda fd: None)
    if kind == "mkdir":
        return os.mkdir(p, args[1])
    if kind == "rmdir":
        return os.rmdir(p)
    if kind == "unlink":
        return os.unlink(p)
    if kind == "rename":
        return os.rename(p, args[1])
    if kind == "link":
        return os.link(p, args[1], follow_symlinks=False)
    if kind == "symlink":
        return os.symlink(p, args[1])
    if kind == "mknod":
        return _mknod(p, *args[1:])
    if kind == "mkfifo":
        return os.mkfifo(p, args[1])
    if kind == "sock":
        return _sock(p)
    if kind == "chmod":
        return os.chmod(p, args[1])
    if kind in ("chown", "lchown"):
        return os.chown(p, IDS[args[1]], IDS[args[2]], follow_symlinks=kind == "chown")
    if kind == "truncate":
        return os.truncate(p, args[1])
    if kind == "ftruncate":
        return _with_fd(p, _open_flags(args[1]), lambda fd: os.ftruncate(fd, args[2]))
    if kind == "creat0_ftruncate":  # a file created with mode 0 is still writable through its fd
        return _with_fd(p, os.O_CREAT | os.O_EXCL | os.O_RDWR,
                        lambda fd: (os.ftruncate(fd, 10), os.pwrite(fd, b"abc", 0), os.fstat(fd).st_size)[2],
                        0)
    if kind == "fchmod_write":  # the fd keeps the access it was opened with
        return _with_fd(p, os.O_RDWR, lambda fd: (os.fchmod(fd, 0), os.pwrite(fd, b"zz", 1),
                                                  os.fsync(fd))[1])
    if kind == "write":
        return _with_fd(p, os.O_WRONLY, lambda fd: os.pwrite(fd, b"w" * args[2], args[1]))
    if kind == "read":
        return _with_fd(p, os.O_RDONLY, lambda fd: hashlib.md5(os.read(fd, 1 << 20)).hexdigest())
    if kind == "utime_now":
        return os.utime(p, None, follow_symlinks=False)
    if kind == "utime_set":
        return os.utime(p, ns=(1_000_000_000, 2_000_000_000), follow_symlinks=False)
    if kind == "access":
        return os.access(p, args[1], follow_symlinks=False)
    if kind == "setxattr":
        return os.setxattr(p, args[1], _xattr_value(args[2]), args[3], follow_symlinks=False)
    if kind == "getxattr":
        return os.getxattr(p, args[1], follow_symlinks=False).decode()
    if kind == "listxattr":
        return _list_xattrs(p)
    if kind == "removexattr":
        return os.removexattr(p, args[1], follow_symlinks=False)
    if kind == "fallocate":
        return _fallocate(p, *args[1:])
    if kind == "stat":
        return _describe(os.lstat(p))
    raise AssertionError(kind)


OP_KINDS = ["creat", "open", "mkdir", "rmdir", "unlink", "rename", "link", "symlink", "mknod", "mkfifo",
            "sock", "chmod", "chown", "lchown", "truncate", "ftruncate", "creat0_ftruncate", "fchmod_write",
            "write", "read", "utime_now", "utime_set", "access", "setxattr", "getxattr", "listxattr",
            "removexattr", "fallocate", "stat"]
TIMED = {"creat", "mkdir", "rmdir", "unlink", "rename", "link", "symlink", "mknod", "mkfifo", "chmod",
         "chown", "lchown", "truncate", "ftruncate", "write", "setxattr", "removexattr", "utime_now",
         "fchmod_write", "sock"}


def _describe(s: os.stat_result) -> dict:
    fmt = stat.S_IFMT(s.st_mode)
    d = {"type": fmt, "mode": oct(stat.S_IMODE(s.st_mode)), "uid": s.st_uid, "gid": s.st_gid,
         "rdev": s.st_rdev}
    d["nlink"] = s.st_nlink  # a directory's: 2 + its subdirectories on both
    if fmt != stat.S_IFDIR:  # a directory's size is the file system's own business
        d["size"] = s.st_size
    return d


def _times(path: str):
    try:
        s = os.lstat(path)
    except OSError:
        return None
    return s.st_mtime_ns, s.st_ctime_ns


ALL_PATHS = ["."] + list(DIRS) + [f"{d}/{n}" for d in DIRS for n in dict.fromkeys(NAMES)]


ALL_SET = frozenset(ALL_PATHS)


def _all_times() -> dict:
    """(mtime, ctime) of every path of ALL_PATHS that exists and is listed (directories the actor may not
    read are skipped alike on both sides); listing first spares lookups of names that do not exist."""
    out = {".": _times(".")}
    for d in DIRS:
        try:
            with os.scandir(d) as it:
                names = [e.name for e in it]
        except OSError:
            continue
        out[d] = _times(d)
        for n in names:
            if f"{d}/{n}" in ALL_SET:
                out[f"{d}/{n}"] = _times(f"{d}/{n}")
    return out


def _moved_times(kind: str, args: list, before: dict, after: dict) -> list:
    """Which paths' mtime / ctime the call moved ("m", "c"), by path; a renamed inode is followed to its
    new name."""
    moved = []
    for p in ALL_PATHS:
        b, a = before.get(p), after.get(p)
        if b is not None and a is not None and b != a:
            moved.append([p, "m" * (a[0] != b[0]) + "c" * (a[1] != b[1])])
    if kind == "rename" and before.get(args[0]) and after.get(args[1]):
        b, a = before[args[0]], after[args[1]]
        moved.append(["renamed", "m" * (a[0] != b[0]) + "c" * (a[1] != b[1])])
    return moved


CALL_TIMEOUT_S = 60.0  # one call, on a loaded machine, through FUSE


def _serve(uid: int, gid: int, groups: tuple, requests: int, replies: int) -> None:
    """A worker's loop, with its credentials: one JSON request line in, one JSON reply line out."""
    os.setgroups(list(groups))
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    os.umask(0o022)
    with os.fdopen(requests, "r") as inp, os.fdopen(replies, "w") as out:
        for line in inp:  # ends when the parent closes the pipe
            base, kind, args = json.loads(line)
            try:
                reply = _run_here(base, kind, args)
            except BaseException as e:  # noqa: BLE001 - reported to the parent, never raised here
                reply = ["crash", repr(e)]
            out.write(json.dumps(reply) + "\n")
            out.flush()


def _run_here(base: str, kind: str, args: list) -> list:
    os.chdir(base)
    timed = kind in TIMED
    before = _all_times() if timed else {}
    if timed:
        time.sleep(TIME_SLEEP_S)
    try:
        out = ["ok", _call(kind, args)]
    except OSError as e:
        out = ["err", errno.errorcode.get(e.errno, str(e.errno))]
    if timed and out[0] == "ok":
        out.append(_moved_times(kind, args, before, _all_times()))
    return out


class Actors:
    """One forked worker process per actor, holding that actor's credentials for its lifetime (a fork
    per call costs more than the call). Stop with close(); workers are ours, ended by pid."""

    def __init__(self):
        self._workers: dict[str, tuple[int, object, object]] = {}
        for name, (uid, gid, groups) in ACTORS.items():
            req_r, req_w = os.pipe()
            rep_r, rep_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(req_w)
                    os.close(rep_r)
                    for _, other_req, other_rep in self._workers.values():  # their EOF is theirs
                        other_req.close()
                        other_rep.close()
                    _serve(uid, gid, groups, req_r, rep_w)
                except BaseException:  # noqa: BLE001
                    code = 1
                finally:
                    os._exit(code)
            os.close(req_r)
            os.close(rep_w)
            self._workers[name] = (pid, os.fdopen(req_w, "w"), os.fdopen(rep_r, "r"))

    def call(self, actor: str, base: str, kind: str, args: list) -> list:
        """Run one call as `actor` in `base`: ["ok", value] or ["err", errno name], then (for calls that
        change things) which paths' mtime/ctime moved."""
        import select

        pid, requests, replies = self._workers[actor]
        requests.write(json.dumps([base, kind, args]) + "\n")
        requests.flush()
        ready, _, _ = select.select([replies], [], [], CALL_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"{actor} did not answer {kind} {args} within {CALL_TIMEOUT_S} s")
        line = replies.readline()
        if not line:
            raise RuntimeError(f"worker of {actor} (pid {pid}) exited")
        return json.loads(line)

    def close(self) -> None:
        for pid, requests, replies in self._workers.values():
            requests.close()
            replies.close()
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self._workers.clear()


# -- the tree ---------------------------------------------------------------------------------------------


def setup_tree(base: str) -> None:
    """The starting tree, made as root (in this process)."""
    os.makedirs(base)
    os.chmod(base, 0o755)
    for name, (mode, uid, gid) in DIRS.items():
        p = os.path.join(base, name)
        os.mkdir(p)
        os.chown(p, uid, gid)
        os.chmod(p, mode)
    for name, (mode, uid, gid) in SUBDIRS.items():
        p = os.path.join(base, name)
        os.mkdir(p)
        os.chown(p, uid, gid)
        os.chmod(p, mode)
    for name, (mode, uid, gid) in FILES.items():
        p = os.path.join(base, name)
        with open(p, "wb") as f:
            f.write(b"hello")
        os.chown(p, uid, gid)
        os.chmod(p, mode)
    for name, target in SYMLINKS.items():
        os.symlink(target, os.path.join(base, name))


def snapshot(base: str) -> dict:
    """Everything both sides must agree on at the end, per path (as root)."""
    out = {}
    for top, dirs, files in os.walk(base):
        dirs.sort()
        for name in sorted(dirs + files):
            p = os.path.join(top, name)
            s = os.lstat(p)
            d = _describe(s)
            try:
                names = _list_xattrs(p)
                d["xattrs"] = {n: os.getxattr(p, n, follow_symlinks=False).hex() for n in names}
            except OSError as e:
                d["xattrs"] = errno.errorcode.get(e.errno)
            if stat.S_ISREG(s.st_mode):
                try:
                    with open(p, "rb") as f:
                        d["md5"] = hashlib.md5(f.read()).hexdigest()
                except OSError as e:
                    d["md5"] = errno.errorcode.get(e.errno)
            elif stat.S_ISLNK(s.st_mode):
                d["target"] = os.readlink(p)
            out[os.path.relpath(p, base)] = d
    return out


def remove_tree(base: str) -> None:
    shutil.rmtree(base, ignore_errors=True)
    if os.path.exists(base):
        shutil.rmtree(base)


def run_sequence(actors: Actors, base: str, ops: list[list]) -> dict:
    setup_tree(base)
    try:
        results = [actors.call(op[0], base, op[1], op[2:]) for op in ops]
        return {"results": results, "tree": snapshot(base)}
    finally:
        remove_tree(base)


def differences(ref: dict, got: dict, ops: list[list]) -> list[str]:
    """What differs, readably (empty: the same)."""
    out = []
    for i, (a, b) in enumerate(zip(ref["results"], got["results"])):
        if a != b:
            out.append(f"op {i} {ops[i]}: reference {a}, mount {b}")
    for path in sorted(set(ref["tree"]) | set(got["tree"])):
        a, b = ref["tree"].get(path), got["tree"].get(path)
        if a != b:
            out.append(f"tree {path}: reference {a}, mount {b}")
    return out


class Differ:
    """Runs sequences on both sides: `ref` (a local directory) and `mnt` (on the mount)."""

    def __init__(self, ref_dir: str, mnt_dir: str):
        self.ref_dir, self.mnt_dir = ref_dir, mnt_dir
        self._n = 0
        self.actors = Actors()

    def close(self) -> None:
        self.actors.close()

    def diff(self, ops: list[list]) -> list[str]:
        self._n += 1
        name = f"seq{self._n}"
        ref = run_sequence(self.actors, os.path.join(self.ref_dir, name), ops)
        got = run_sequence(self.actors, os.path.join(self.mnt_dir, name), ops)
        return differences(ref, got, ops)

    def shrink(self, ops: list[list]) -> list[list]:
        """The shortest sub-sequence (by dropping single ops, repeatedly) that still differs."""
        changed = True
        while changed:
            changed = False
            for i in range(len(ops)):
                trial = ops[:i] + ops[i + 1:]
                if trial and self.diff(trial):
                    ops, changed = trial, True
                    break
        return ops


# -- the pass-rate report -----------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    import argparse
    import collections
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--mount", help="an existing threefs mount (default: start a cluster and mount it)")
    ap.add_argument("--show", type=int, default=0, help="print the differences of this many sequences")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (daemon log)")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="posix-diff-")
    os.chmod(work, 0o755)
    ref = os.path.join(work, "ref")
    os.mkdir(ref)
    os.chmod(ref, 0o755)
    stack = []
    try:
        mnt = args.mount or _start_mount(work, stack)
        mdir = os.path.join(mnt, f"posix-diff-{os.getpid()}")
        os.mkdir(mdir)
        os.chmod(mdir, 0o755)
        differ = Differ(ref, mdir)
        stack.append(differ.close)
        passed, by_kind, examples = 0, collections.Counter(), {}
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            ops = generate(random.Random(seed))
            diffs = differ.diff(ops)
            if not diffs:
                passed += 1
                continue
            if args.show > 0:
                args.show -= 1
                print(f"seed {seed}: {json.dumps(ops)}\n  " + "\n  ".join(diffs))
            for line in diffs:
                if line.startswith("op "):
                    kind = line.split("'")[3]
                    by_kind[kind] += 1
                    examples.setdefault(kind, line)
        print(f"work directory {work}")
        print(f"{passed}/{args.seeds} sequences identical ({100 * passed / args.seeds:.1f}%)")
        for kind, n in by_kind.most_common():
            print(f"  {kind:18} {n:4}  e.g. {examples[kind][:200]}")
        return 0
    finally:
        for undo in reversed(stack):
            undo()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _start_mount(work: str, stack: list) -> str:
    from threefs.cli.cluster import LocalCluster
    from threefs.client import fuse_mount

    cluster = LocalCluster(os.path.join(work, "cluster"))
    stack.append(cluster.down)
    cluster.up(3, 3)
    mnt = os.path.join(work, "mnt")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, ["--allow-other"],
                            os.path.join(work, "fuse.log"))
    stack.append(lambda: fuse_mount.stop(proc, mnt))
    return mnt


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
