"""The FUSE daemon's view of the namespace: kernel inode numbers and the meta operations the daemon
needs, on (parent inode, name) and inodes as FUSE gives them, each acting for the calling process.

Inode numbers: threefs's root is inode 0 and FUSE's is 1 (threefs inode 1 is the GC root, never visible),
so the root is swapped and every other inode keeps its number: `st_ino` equals `threefs stat`'s inode.

Meta resolves (parent inode, name) and inodes itself (3FS's "path at"), so the daemon keeps no paths:
a rename or unlink elsewhere can never make it act on the wrong file. Every call carries the caller's
uid, gid and groups (the daemon's cluster token may act for any user), so meta checks permissions and
new files belong to whoever created them.

Directory attributes after this daemon's own changes (ChangedDirs): the kernel forgets a directory's
attributes whenever an entry in it changes (fs/fuse fuse_dir_changed) and, with `default_permissions`, asks
for them again at the next path walk through it; meta's reply to the change carries them as its
transaction committed them, so that GETATTR is answered from them (once, within CHANGED_DIR_FRESH_S).

Permissions have one source of truth: the kernel. The mount uses `default_permissions`, so the kernel has
checked every call with the caller's full credentials (supplementary groups and capabilities included)
before it reaches the daemon; the credential goes to meta marked `kernel_checked`, and meta checks nothing
again (it would only get it wrong: FUSE tells the daemon uid, gid and pid, not the credentials the call
was made with).
"""

from __future__ import annotations

import time

from threefs.common import limits
from threefs.common.ids import ROOT_INODE as META_ROOT
from threefs.rpc.schemas import meta as m

FUSE_ROOT = 1
GROUPS_CACHE_S = 1.0  # supplementary groups of a pid are read from /proc at most this often
GROUPS_CACHE_MAX = 1024
GIDS_MAX = 64  # meta's limit (meta/users.py)
NEW_DIRS_MAX = 4096  # directories made by this mount whose untouched names are known absent (NewDirs)
CHANGED_DIR_FRESH_S = 1.0  # a directory's attributes from a change answer a GETATTR at most this much later
CHANGED_DIRS_MAX = 4096  # directories kept at once (more: all are forgotten; each costs a meta getattr)


def to_fuse(inode: int) -> int:
    return FUSE_ROOT if inode == META_ROOT else inode


def to_meta(ino: int) -> int:
    return META_ROOT if ino == FUSE_ROOT else ino


def decode(name: bytes) -> str:
    """FUSE names are bytes; meta stores str, with surrogateescape for bytes that are not UTF-8."""
    return name.decode("utf-8", "surrogateescape")


class ChangedDirs:
    """Directories' attributes as this daemon's own entry changes committed them (meta's `parents`), kept to
    answer the kernel's next GETATTR of each directory without a meta call: that GETATTR follows the change
    because the kernel invalidated the directory's attributes at it (fuse_dir_changed), and meta would answer
    what the change committed, unless another client changed the directory in between, which the kernel's
    own cache (30 s) would hide just the same.

    Each is answered once (`take`), at most `fresh_s` after the change returned. Kept only when nothing
    else of this daemon changed the directory meanwhile: every local change of a directory (entry changes,
    setattr, xattrs) is `begin` ... `end`, and a directory's attributes are kept at the end of a change only
    when no other change of it was in flight at any time during this one (its reply may come before one
    that committed later); one in flight makes `take` answer None (meta is asked). Changes of directories
    not known by number (rename and rmdir: the directory moved or removed is named, not numbered) are
    `everything=True`: they forget all kept attributes, and no change that overlaps one keeps any.
    Attributes the kernel gets from meta (a lookup, a getattr, an opendir's getattr, a listing) make the
    kept ones go, and a change in flight keep none (`forget`)."""

    def __init__(self, fresh_s: float = CHANGED_DIR_FRESH_S, clock=time.monotonic):
        self.fresh_s = fresh_s
        self._clock = clock
        self._kept: dict[int, tuple[float, m.InodeAttr]] = {}  # fuse ino -> (when, attributes)
        self._busy: dict[int, list[int]] = {}  # fuse ino -> [changes in flight, changes begun]
        self._all_busy = 0  # everything=True changes in flight
        self._all_gen = 0  # everything=True changes begun
        self._kept_files: set[int] = set()  # kept inodes that are not directories (a setattr's file)

    def begin(self, inos, everything: bool = False) -> tuple:
        # this change may keep what it returns only if no other change was in flight when it began and
        # none begins before it ends: then nothing of this daemon can have committed after it unseen
        calm = self._all_busy == 0
        if everything:
            self._all_busy += 1
            self._all_gen += 1
            self._kept.clear()
        mine = []
        for ino in dict.fromkeys(inos):
            self._kept.pop(ino, None)
            b = self._busy.get(ino)
            if b is None:
                b = self._busy[ino] = [0, 0]
            mine.append((ino, b[1] + 1, calm and b[0] == 0))
            b[0] += 1
            b[1] += 1
        return self._all_gen, mine, everything

    def end(self, token: tuple, parents: list[m.InodeAttr]) -> None:
        """The change `token` (from begin) returned the directories' attributes `parents` (meta inodes)."""
        all_gen, mine, everything = token
        if everything:
            self._all_busy -= 1
        got = {to_fuse(a.inode): a for a in parents}  # directories, and the inode a setattr changed
        now = self._clock()
        for ino, gen, calm in mine:
            b = self._busy[ino]
            b[0] -= 1
            alone = calm and b[1] == gen and self._all_gen == all_gen
            if b[0] == 0:
                del self._busy[ino]
            attr = got.get(ino)
            if alone and attr is not None and self.fresh_s > 0:
                if len(self._kept) >= CHANGED_DIRS_MAX:
                    self._kept.clear()
                    self._kept_files.clear()
                self._kept[ino] = (now, attr)
                if attr.type != m.DIRECTORY:
                    self._kept_files.add(ino)
            else:
                self._kept.pop(ino, None)

    def take(self, ino: int) -> m.InodeAttr | None:
        """The kept attributes of directory `ino`, once; None when there are none to trust."""
        hit = self._kept.pop(ino, None)
        if hit is None or ino in self._busy or self._all_busy or self._clock() - hit[0] > self.fresh_s:
            return None
        return hit[1]

    def forget_files(self) -> None:
        """A change of the namespace (an entry created, removed, linked, renamed): a file's kept attributes
        may be stale by it (its nlink, its ctime) and this daemon may not know the file by number: all go."""
        for ino in self._kept_files:
            self._kept.pop(ino, None)
        self._kept_files.clear()

    def forget(self, ino: int) -> None:
        """The kernel got attributes of `ino` from meta (a lookup, getattr, opendir, listing): drop the
        kept ones, and keep none from a change of it in flight (its reply may be older than these)."""
        self._kept.pop(ino, None)
        b = self._busy.get(ino)
        if b is not None:
            b[1] += 1

    def kept(self) -> int:
        return len(self._kept)


class NewDirs:
    """Directories this mount made, each for `fresh_s` (the negative timeout) after its mkdir returned: a name
    in one that this mount has not touched since cannot exist unless another client made it meanwhile, and
    the kernel may miss exactly that for as long as it keeps a negative entry (the negative timeout, 3FS's
    5 s). So the kernel's lookup of such a name (its LOOKUP before every create of a new file: `tar x`,
    `cp -r`, a checkpoint's files, `pip install`) is answered "no such name" here, without a meta call.
    Every name this mount creates, removes or renames in the directory is `touch`ed before its call goes
    out, and a touched name is always asked of meta (meta is the authority on what this mount did, even on
    a call that failed or timed out). Off with a negative timeout of 0."""

    def __init__(self, fresh_s: float, clock=time.monotonic):
        self.fresh_s = fresh_s
        self._clock = clock
        self._dirs: dict[int, tuple[float, set[str]]] = {}  # fuse ino -> (deadline, names touched)

    def made(self, ino: int) -> None:
        if self.fresh_s <= 0:
            return
        if len(self._dirs) >= NEW_DIRS_MAX:  # the oldest first (insertion order), expired or not
            now = self._clock()
            for old in [i for i, (deadline, _) in self._dirs.items() if deadline <= now]:
                del self._dirs[old]
            while len(self._dirs) >= NEW_DIRS_MAX:
                del self._dirs[next(iter(self._dirs))]
        self._dirs[ino] = (self._clock() + self.fresh_s, set())

    def touch(self, parent: int, name: str) -> None:
        entry = self._dirs.get(parent)
        if entry is not None:
            entry[1].add(name)

    def absent_for(self, parent: int, name: str) -> float:
        """Seconds for which `name` in `parent` is known not to exist (0: ask meta)."""
        entry = self._dirs.get(parent)
        if entry is None:
            return 0.0
        left = entry[0] - self._clock()
        if left <= 0:
            del self._dirs[parent]
            return 0.0
        return 0.0 if name in entry[1] else left

    def forget(self, ino: int) -> None:
        self._dirs.pop(ino, None)

    def tracked(self) -> int:
        return len(self._dirs)


class Namespace:
    def __init__(self, aio):
        self.aio = aio
        self._lookups: dict[int, int] = {}  # the kernel's references per fuse ino
        self._groups: dict[int, tuple[float, tuple[int, ...]]] = {}

    # -- the kernel's references -----------------------------------------------------------------
    def remember(self, ino: int) -> None:
        if ino != FUSE_ROOT:
            self._lookups[ino] = self._lookups.get(ino, 0) + 1

    def forget(self, ino: int, count: int) -> bool:
        """Drop `count` references; True when the kernel holds none any more."""
        left = self._lookups.get(ino, 0) - count
        if left > 0:
            self._lookups[ino] = left
            return False
        self._lookups.pop(ino, None)
        return True

    def known(self) -> int:
        return len(self._lookups)

    # -- who is calling --------------------------------------------------------------------------
    def user(self, ctx) -> m.UserCred | None:
        """The calling process's credentials (None when the kernel gave no context)."""
        if ctx is None:
            return None
        return m.UserCred(ctx.uid, ctx.gid, self._sup_groups(ctx.pid, ctx.gid), kernel_checked=True)

    def _sup_groups(self, pid: int, gid: int) -> tuple[int, ...]:
        now = time.monotonic()
        hit = self._groups.get(pid)
        if hit is not None and now - hit[0] < GROUPS_CACHE_S:
            return hit[1]
        import pyfuse3

        try:
            groups = tuple(sorted(g for g in pyfuse3.get_sup_groups(pid) if g != gid))[:GIDS_MAX]
        except (OSError, RuntimeError):  # the process is gone: its primary group is all we know
            groups = ()
        if len(self._groups) >= GROUPS_CACHE_MAX:
            self._groups.clear()
        self._groups[pid] = (now, groups)
        return groups

    # -- meta operations -------------------------------------------------------------------------
    async def lookup(self, parent: int, name: str, user) -> m.InodeAttr | None:
        """None (or FileNotFoundError, from an older meta) when the name does not exist."""
        return await self.aio.lookup(to_meta(parent), name, user, missing_ok=True)

    async def getattr(self, ino: int, user) -> m.InodeAttr:
        return await self.aio.getattr(to_meta(ino), user)

    async def readdir_page(self, ino: int, after: str, user) -> tuple[list[m.DirEntry], bool]:
        """Entries after the name `after`, one page, and whether more follow."""
        rsp = await self.aio.readdir("", after, limits.READDIR_PAGE_MAX, parent=to_meta(ino), user=user)
        return rsp.entries, rsp.more and bool(rsp.entries)

    async def lookup_many(self, parent: int, names: list[str], user) -> list[m.InodeAttr | None]:
        """Attributes of several entries of one directory in one meta call (None: gone meanwhile)."""
        assert len(names) <= limits.BATCH_STAT_MAX
        out = await self.aio.batch_stat([(to_meta(parent), n) for n in names], follow=False, user=user)
        return [a if isinstance(a, m.InodeAttr) else None for a in out]

    async def mkdir(self, parent: int, name: str, mode: int, user) -> m.AttrRsp:
        return await self.aio.mkdir_at(to_meta(parent), name, mode, user)

    async def create(self, parent: int, name: str, flags: int, mode: int, user) -> m.OpenRsp:
        return await self.aio.create_at(to_meta(parent), name, flags, mode, user)

    async def open(self, ino: int, flags: int, user) -> m.OpenRsp:
        return await self.aio.open_inode(to_meta(ino), flags, user)

    async def unlink(self, parent: int, name: str, user) -> m.ChangedRsp:
        return await self.aio.unlink_at(to_meta(parent), name, user)

    async def rmdir(self, parent: int, name: str, user) -> m.ChangedRsp:
        return await self.aio.rmdir_at(to_meta(parent), name, user)

    async def rename(self, parent: int, name: str, new_parent: int, new_name: str, noreplace: bool,
                     user) -> m.ChangedRsp:
        return await self.aio.rename_at(to_meta(parent), name, to_meta(new_parent), new_name, noreplace,
                                        user)

    async def setattr(self, ino: int, user, **fields) -> m.InodeAttr:
        """chmod / chown / utimens / truncate (length=...) of the inode itself."""
        return await self.aio.setattr("", parent=to_meta(ino), follow=False, user=user, **fields)

    async def setattr_published(self, ino: int, user, publish: tuple[m.InodeAttr, str, int] | None,
                                **fields) -> m.AttrRsp:
        """setattr, with `publish` (the writer's attr, session, length hint) published first in the same
        meta transaction (AttrRsp.published says whether the server did)."""
        req = None
        if publish is not None:
            attr, session, hint = publish
            req = m.SyncReq(attr.inode, session, hint, attr.truncate_ver)
        return await self.aio.setattr_rsp("", parent=to_meta(ino), follow=False, user=user, publish=req,
                                          **fields)

    async def symlink(self, parent: int, name: str, target: str, user) -> m.AttrRsp:
        return await self.aio.symlink_at(to_meta(parent), name, target, user)

    async def mknod(self, parent: int, name: str, kind: int, mode: int, rdev: int, user) -> m.AttrRsp:
        req = m.MknodReq(name, kind, mode, rdev, to_meta(parent), user)
        return await self.aio.meta_call("mknod", req, m.AttrRsp)

    async def xattr(self, ino: int, op: str, user, name: str = "", value: bytes = b"",
                    flags: int = 0) -> m.XattrRsp:
        """get / set / list / remove an extended attribute of the inode itself."""
        req = m.XattrReq(op, "", name, value, flags, follow=False, parent=to_meta(ino), user=user)
        return await self.aio.meta_call("xattr", req, m.XattrRsp)

    async def link(self, ino: int, new_parent: int, new_name: str, user) -> m.AttrRsp:
        return await self.aio.link_at(to_meta(ino), to_meta(new_parent), new_name, user)

    async def readlink(self, ino: int, user) -> str:
        return await self.aio.readlink("", parent=to_meta(ino), user=user)

    async def sync(self, attr: m.InodeAttr, session: str, length_hint: int) -> m.InodeAttr:
        """Publish a writer's length (valid for the truncate version the writer knows)."""
        return await self.aio.sync_file(attr.inode, session, length_hint, attr.truncate_ver)

    async def close(self, inode: int, session: str, length_hint: int) -> m.InodeAttr:
        return await self.aio.close_file(inode, session, length_hint)

    async def statfs(self) -> m.StatfsRsp:
        return await self.aio.statfs()
