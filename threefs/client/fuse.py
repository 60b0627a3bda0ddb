"""The FUSE file system: pyfuse3's low-level (inode) API over the asyncio client, in one event loop.

pyfuse3 runs in asyncio mode (`pyfuse3.asyncio.enable()`), so kernel requests and the client's RPCs
share one uvloop loop and no request crosses a thread. Data goes straight between the kernel's request
buffers and storage; meta is asked only for namespace operations, open and close.

- reads: read-ahead per handle (stream.ReadAhead, the engine File objects use too), clamped to the
  length this daemon knows (meta's, raised by writes in flight);
- writes: write-behind per handle (stream.WriteBehind); flush (every close(2)) and fsync
  drain it and publish the length to meta, release ends the write session;
- errors: every ThreeFSError/OSError becomes its errno; anything else is logged and becomes EIO.

The kernel's page cache holds file data across opens with close-to-open consistency (as NFS and 3FS's
FUSE client): an open keeps the pages cached (FOPEN_KEEP_CACHE) only when the file meta reports at that
open has the length, mtime and truncate version it had when the pages were cached, and this daemon wrote
nothing to it since; otherwise the kernel drops them, and its cached attributes too (a size changed by
another client is seen by the next open). No writeback cache by default: with it the kernel never takes
a regular file's size or mtime from the daemon again while it caches the inode, so another client's
writes would stay invisible (docs/fuse.md).

Concurrent reads that go to storage wait until the kernel's queue of requests has been taken in (the
/dev/fuse descriptor is polled), so that an io_depth of 32 becomes one storage batch (ReadCoalescer).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import itertools
import logging
import os
import time
import select
import stat
from dataclasses import dataclass, field

import msgspec
import pyfuse3

from threefs.client.batch import ReadCoalescer
from threefs.client.fuse_store import PageStore
from threefs.client.fuse_namespace import (CHANGED_DIR_FRESH_S, FUSE_ROOT, ChangedDirs, Namespace, NewDirs,
                                           decode, to_fuse)
from threefs.client.stream import SEGMENT_BYTES_MAX, ReadAhead, WriteBehind, read_leased, segment_bytes
from threefs.common import limits
from threefs.common.buffers import BufferPool
from threefs.common.status import StatusCode, ThreeFSError, errno_of
from threefs.rpc.schemas import meta as m

log = logging.getLogger(__name__)

TYPE_BITS = {m.FILE: stat.S_IFREG, m.DIRECTORY: stat.S_IFDIR, m.SYMLINK: stat.S_IFLNK, m.FIFO: stat.S_IFIFO,
             m.CHARDEV: stat.S_IFCHR, m.BLOCKDEV: stat.S_IFBLK, m.SOCKET: stat.S_IFSOCK}
SPECIAL_OF_BITS = {stat.S_IFIFO: m.FIFO, stat.S_IFCHR: m.CHARDEV, stat.S_IFBLK: m.BLOCKDEV,
                   stat.S_IFSOCK: m.SOCKET}
OPEN_FLAGS_PASSED = os.O_ACCMODE | os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_APPEND
DOT_ENTRIES = 2  # a listing starts with '.' and '..' (DirHandle.entries)
READDIR_LOOKUP_BATCH = limits.BATCH_STAT_MAX  # entries whose attributes one meta call fetches (a readdir page)
STATFS_BLOCK_BYTES = 4096
READ_POOL_BYTES_MAX = 64 * limits.MiB  # reply buffers kept for reuse (fresh pages fault per 4 KiB)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
ZERO_PIECE_BYTES = limits.MiB  # zeros of a punched hole go to storage this many bytes per write
KERNEL_CHECKED = m.UserCred(0, 0, kernel_checked=True)  # requests without a caller (fallocate)


PAGE_BYTES = 4096
CAPABILITY_XATTR = "security.capability"
SMALL_READ_BYTES = 128 * limits.KiB  # smaller requests that do not continue the last one: no read-ahead
DEFERRED_CLOSE_S = 0.2  # as client.py: an untouched write session ends in a batch at most this much later
DEFERRED_CLOSES_MAX = 128
GATE_IDLE_TURNS = 8  # loop turns without a new read joining before the held reads go anyway
GATE_TURNS_MAX = 256  # loop turns a read is held at most


@dataclass
class MountOptions:
    # how long the kernel may cache attributes, names and names that do not exist (3FS's FUSE client:
    # 30 s, 30 s, 5 s); an open always asks meta, so file contents follow close-to-open regardless
    attr_timeout_s: float = 30.0
    entry_timeout_s: float = 30.0
    negative_timeout_s: float = 5.0
    direct_io: bool = False  # bypass the page cache (every read/write reaches the daemon)
    writeback_cache: bool = False  # the kernel gathers small writes (and owns sizes and mtimes: see above)
    keep_cache: bool = True  # keep cached pages across opens of an unchanged file (close-to-open)
    max_background: int = 64  # kernel requests in flight in the background (async direct IO, read-ahead)
    write_behind_bytes: int = 64 * limits.MiB  # per open file
    read_ahead_bytes: int = 16 * limits.MiB  # prefetched per sequentially read open file
    read_ahead_kb: int = 4096  # the mount's bdi read_ahead_kb (FUSE requests are at most 1 MiB)
    segment_bytes: int = 4 * limits.MiB  # read-ahead / write-behind IO unit (whole chunks, at least this)
    allow_other: bool = False  # `threefs mount` turns it on when root mounts (cli/mount_cmd.allow_other)
    dir_cache: bool = True  # the kernel caches directory listings (dropped at opendir when changed)
    gate_batch: int = 64  # reads held at the gate for one storage batch at most (KernelQueueGate)
    fast_dispatch: bool = True  # kernel requests taken without per-request epoll changes, workers kept
    # a directory's attributes from this daemon's own change of its entries answer the kernel's next
    # getattr of it within this many seconds (fuse_namespace.ChangedDirs); 0: meta answers every getattr
    changed_dir_s: float = CHANGED_DIR_FRESH_S
    # a small buffered read that misses the page cache reads this aligned window around it and the
    # kernel's page cache gets the rest (fuse_store); 0: off
    read_around_bytes: int = 64 * limits.KiB
    # ... and a second such miss within one aligned region of this size reads the whole region: a file
    # read densely at random fills the page cache in regions, one read at random once in a while keeps
    # to small windows (fuse_store); at most the windows' size: never
    read_around_region_bytes: int = limits.MiB
    # ... of files no longer than this (None: a quarter of the machine's memory): the pages of a larger
    # file read at random are mostly evicted before they are read again
    read_around_file_max: int | None = None


@dataclass
class Handle:
    ino: int
    attr: m.InodeAttr
    session: str
    writer: WriteBehind | None
    reader: ReadAhead
    written_end: int = -1  # highest end written through this handle
    read_end: int = 0  # where the last read request ended (a small read elsewhere is a random read)
    published_end: int = -1  # highest end meta has been told about
    truncated: bool = False  # the session's truncate version is stale: hints go with attr's
    # --direct-io: the first write through the handle clears the set-id bits (see _kill_privs)
    kill_privs: bool = False
    direct: bool = False  # opened with O_DIRECT: its reads bypass the page cache


@dataclass
class DirHandle:
    """An open directory: its entries, fetched a page at a time as the kernel reads on."""

    ino: int
    user: m.UserCred | None
    # '.' and '..' first (as every Linux file system lists them; their attributes come with the first
    # batch like any entry's; the kernel takes no reference to them), then the pages meta returns
    entries: list[m.DirEntry] = field(default_factory=lambda: [m.DirEntry(".", 0, m.DIRECTORY),
                                                               m.DirEntry("..", 0, m.DIRECTORY)])
    more: bool = True
    attrs: dict[int, m.InodeAttr | None] = field(default_factory=dict)  # index -> attr


def fuse_errors(fn):
    """Report every failure to the kernel as an errno (pyfuse3 accepts only FUSEError); count the kernel's
    requests per operation (`ThreeFSOperations.requests`, logged with the statistics)."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        ops = args[0]
        ops.requests[name] += 1
        if ops.spinner is not None:
            ops.spinner.arrived()
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:  # ThreeFSErrors are OSErrors with the matching errno
            log.debug("%s: %s", fn.__name__, e)
            if getattr(e, "errno", None) in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EIO):
                log.warning("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(errno_of(e)) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class ThreeFSOperations(pyfuse3.Operations):
    supports_dot_lookup = False

    def __init__(self, aio, options: MountOptions):
        super().__init__()
        self.aio = aio
        self.options = options
        self.enable_writeback_cache = options.writeback_cache and not options.direct_io
        self.ns = Namespace(aio)
        self.changed = ChangedDirs(options.changed_dir_s)  # directories' attributes from its own changes
        self.new_dirs = NewDirs(options.negative_timeout_s)  # directories it made: untouched names are absent
        self._handles: dict[int, Handle] = {}
        # fuse ino -> its open handles (the per-read checks look at one file's handles, not every open one)
        self._ino_handles: dict[int, list[Handle]] = {}
        self._dirs: dict[int, DirHandle] = {}
        self._fh = itertools.count(1)
        # per inode: (truncate version, length) meta reported last, see _note_length
        self._meta_length: dict[int, tuple[int, int]] = {}
        self.initialized = asyncio.Event()  # set when the kernel's INIT request arrives
        self._pool = BufferPool(bytes_max=READ_POOL_BYTES_MAX)
        self._coalescer = ReadCoalescer(aio)
        self._reading = 0
        self._cached: dict[int, tuple] = {}  # fuse ino -> (length, mtime, truncate version) of its pages
        self._reported: dict[int, tuple] = {}  # fuse ino -> the same, as last told the kernel
        self._gate: KernelQueueGate | None = None
        self._reader = _GatedReader(self)
        self.negotiated: dict = {}  # what INIT settled (fuse_fallocate.install_init)
        self._deferred: list[m.SessionRef] = []  # write sessions to end in the next close_many
        self._deferred_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self.dir_cache = False  # the kernel caches listings (set when fuse_fallocate.install_dir_cache took)
        self._listed: dict[int, tuple] = {}  # fuse ino of a directory -> (mtime, ctime) at its last opendir
        self._store = PageStore()  # read-around: pages for the kernel's page cache (fuse_store)
        self._epoch = collections.Counter()  # fuse ino -> moves whenever stored pages could be stale
        self._around_missed: dict[int, set[int]] = {}  # fuse ino -> regions that had a read-around miss
        self._writers = collections.Counter()  # fuse ino -> its handles open for writing
        self._around_file_max = options.read_around_file_max
        if self._around_file_max is None:
            self._around_file_max = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        self.stats = collections.Counter()  # logged at unmount
        self.requests = collections.Counter()  # kernel requests per operation (fuse_errors), logged too
        # common/spin.py Spinner: while the kernel's requests come close together (a program reading or
        # creating file after file), the loop polls for the next one instead of sleeping (set by fuse_mount)
        self.spinner = None
        # fuse ino -> time.monotonic() until which the file is known to have no security.capability (the
        # kernel asks before every write(2) to a file: file_remove_privs); see getxattr
        self._no_caps: dict[int, float] = {}

    def init(self) -> None:
        self.initialized.set()

    def watch_kernel_queue(self, fd: int) -> None:
        """Hold concurrent storage reads until the kernel's queued requests are in (fd: /dev/fuse)."""
        if fd >= 0:
            self._gate = KernelQueueGate(fd, self.options.gate_batch)

    # -- attributes ------------------------------------------------------------------------------
    def _length(self, ino: int, length: int) -> int:
        """meta's length raised by this daemon's writes that meta does not know yet."""
        length = max(length, self._meta_length.get(ino, (0, -1))[1])
        for h in self._ino_handles.get(ino, ()):
            if h.written_end > length:
                length = h.written_end
        return length

    def _handles_of(self, ino: int) -> list[Handle]:
        """The open handles of `ino` now (a copy: safe to await while going through it)."""
        return list(self._ino_handles.get(ino, ()))

    def _note_length(self, ino: int, truncate_ver: int, length: int) -> None:
        """meta's length of a file as this daemon last learnt it. Within one truncate version a file only
        grows, so an answer that was on its way while a later one landed (a getattr sent before a close
        published more) does not lower it; a truncate (a newer version) does, and older versions' answers
        are ignored. A lowered length made a read end early: the kernel (write-back cache, a partial page
        written) zero-filled the page's rest and wrote the zeros back over data (two `>>` writers)."""
        old = self._meta_length.get(ino)
        if old is None or truncate_ver > old[0]:
            self._meta_length[ino] = (truncate_ver, length)
        elif truncate_ver == old[0] and length > old[1]:
            self._meta_length[ino] = (truncate_ver, length)

    def entry(self, attr: m.InodeAttr) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = to_fuse(attr.inode)
        e.generation = 0
        e.entry_timeout = self.options.entry_timeout_s
        e.attr_timeout = self.options.attr_timeout_s
        e.st_mode = TYPE_BITS.get(attr.type, stat.S_IFREG) | (attr.mode & 0o7777)
        e.st_nlink = attr.nlink
        e.st_uid, e.st_gid = attr.uid, attr.gid
        e.st_rdev = attr.rdev
        if attr.type == m.SYMLINK:
            e.st_size = len(os.fsencode(attr.symlink_target))
        elif attr.type == m.FILE:
            self._note_length(e.st_ino, attr.truncate_ver, attr.length)
            e.st_size = self._length(e.st_ino, -1)  # the noted length: an older answer's own is stale
            stamp = (attr.length, attr.mtime_ns, attr.truncate_ver)
            if self._reported.get(e.st_ino) != stamp:
                self._reported[e.st_ino] = stamp
                self._epoch[e.st_ino] += 1
        else:
            e.st_size = 0
        e.st_blksize = attr.layout.chunk_size if attr.layout and attr.type == m.FILE else 4096
        e.st_blocks = -(-e.st_size // 512)
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = attr.atime_ns, attr.mtime_ns, attr.ctime_ns
        return e

    def _found(self, attr: m.InodeAttr) -> pyfuse3.EntryAttributes:
        """A reply that gives the kernel a reference to attr's inode (lookup, create, mkdir, ...)."""
        ino = to_fuse(attr.inode)
        self.ns.remember(ino)
        self.changed.forget(ino)  # the kernel now has these, fresher than any kept
        return self.entry(attr)

    async def _changing(self, dirs: tuple[int, ...], call, everything: bool = False, itself: bool = False):
        """Await `call`, a change of the directories `dirs` (fuse inodes; `everything`: of directories not
        known by number too, rename and rmdir): meta's reply says what it committed of them, which answers
        the kernel's next getattr of each (ChangedDirs). `itself`: the call changes the inode dirs[0] itself
        (setattr), whatever its type, and the reply (an InodeAttr, or its `attr`) is what it committed."""
        if not itself:
            self.changed.forget_files()
        token = self.changed.begin(dirs, everything)
        parents = ()
        try:
            rsp = await call
            parents = getattr(rsp, "parents", ())
            if itself:
                parents = [*parents, rsp if isinstance(rsp, m.InodeAttr) else rsp.attr]
            return rsp
        finally:
            self.changed.end(token, parents)

    @fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        name = decode(name)
        user = self.ns.user(ctx)
        if name == ".":
            return self._found(await self.ns.getattr(parent_inode, user))
        absent_s = self.new_dirs.absent_for(parent_inode, name) if name != ".." else 0.0
        if absent_s > 0:  # in a directory this mount made moments ago, a name it never touched (NewDirs)
            self.stats["lookups_in_new_dirs"] += 1
            e = pyfuse3.EntryAttributes()
            e.entry_timeout = absent_s
            return e
        try:
            attr = await self.ns.lookup(parent_inode, name, user)
        except FileNotFoundError:  # a directory on the way is gone, or an older meta
            attr = None
        if attr is not None:
            return self._found(attr)
        if self.options.negative_timeout_s <= 0:
            raise pyfuse3.FUSEError(errno.ENOENT)
        e = pyfuse3.EntryAttributes()  # st_ino 0: the kernel caches that the name does not exist
        e.entry_timeout = self.options.negative_timeout_s
        return e

    async def forget(self, inode_list):
        for ino, count in inode_list:
            if self.ns.forget(ino, count):
                self.changed.forget(ino)
                self._meta_length.pop(ino, None)
                self._cached.pop(ino, None)  # the kernel's inode is gone, and its pages with it
                self._reported.pop(ino, None)
                self._listed.pop(ino, None)
                self._epoch.pop(ino, None)
                self._around_missed.pop(ino, None)
                self._no_caps.pop(ino, None)
                self.new_dirs.forget(ino)

    @fuse_errors
    async def getattr(self, inode, ctx=None):
        kept = self.changed.take(inode)
        # the kernel asks again for what this daemon's change gave (of a directory's entries, or a setattr:
        # chown's refresh of the mode before it clears set-id bits) - unless writes wait to be published
        if kept is not None and not (kept.type == m.FILE and self._unpublished(inode)):
            self.stats["getattr_from_change"] += 1
            return self.entry(kept)
        if not self.enable_writeback_cache:  # the kernel asks us for mtime: publish what was written
            await self._publish_writes(inode)
        attr = await self._stale_if_gone(self.ns.getattr(inode, self.ns.user(ctx)))
        self.changed.forget(inode)
        return self.entry(attr)

    def _unpublished(self, ino: int) -> bool:
        return any(h.written_end > h.published_end for h in self._ino_handles.get(ino, ()))

    async def _writes_landed(self, ino: int) -> tuple[Handle, int] | None:
        """The writes of this daemon's handles of `ino` on storage; (handle, length hint) when exactly one
        handle has a length to publish (the caller publishes it with its setattr), else None (all published
        here, as _publish_writes does). A write that failed is published as far as acknowledged, and raised."""
        pending = [h for h in self._handles_of(ino) if h.written_end > h.published_end]
        if len(pending) != 1 or pending[0].writer is None:
            await self._publish_writes(ino)
            return None
        h = pending[0]
        err = await self._land(h)
        if err is not None:
            await self._sync(h, end_session=False)  # what was acknowledged
            raise err
        return (h, h.written_end) if h.written_end > h.published_end else None

    async def _publish_writes(self, ino: int) -> None:
        """The writes of this daemon's handles of `ino` on storage and their length published (3FS's
        sync_on_stat): meta's mtime and length are then those of the writes so far."""
        for h in self._handles_of(ino):
            if h.written_end > h.published_end:
                await self._sync(h, end_session=False)

    @staticmethod
    async def _stale_if_gone(call):
        """An inode the kernel knows but meta no longer has (removed by another client while the kernel
        cached the name) is ESTALE: the kernel then looks the name up again and retries once."""
        try:
            return await call
        except FileNotFoundError:
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    @fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        user = self.ns.user(ctx)
        publish = None
        if fields.update_mtime:
            # A time set explicitly (tar, cp -p and rsync set it on the open file before closing it) must
            # not be moved by the publication of writes made before it: meta moves mtime to its clock when
            # a length is published. So they are published first: in the setattr's own meta transaction
            # (one call), or before it (a truncate in the same request, several handles, an older meta).
            if fields.update_size:
                await self._publish_writes(inode)
            else:
                publish = await self._writes_landed(inode)
        if fields.update_size:
            await self._truncate(inode, attr.st_size, user)
        changes = {}
        if fields.update_mode:
            changes["mode"] = stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
        # chown(-1, -1) sends FATTR_CTIME alone (regular files) or nothing at all (others): it still moves
        # ctime, which meta's setattr does
        if changes or fields.update_ctime or not fields.update_size:
            if publish is None:
                return self.entry(await self._changing((inode,), self.ns.setattr(inode, user, **changes),
                                                       itself=True))
            h, hint = publish
            rsp = await self._changing((inode,), self.ns.setattr_published(inode, user, (h.attr, h.session, hint),
                                                                           **changes), itself=True)
            if not rsp.published:  # a meta server that predates it: publish, then set the times again
                await self._publish_writes(inode)
                return self.entry(await self._changing((inode,), self.ns.setattr(inode, user, **changes),
                                                       itself=True))
            h.published_end = max(h.published_end, hint)
            h.attr = rsp.attr
            return self.entry(rsp.attr)
        return self.entry(await self.ns.getattr(inode, user))

    async def _truncate(self, ino: int, length: int, user) -> None:
        await self.end_deferred()
        for h in self._handles_of(ino):
            if h.writer is not None:
                await h.writer.flush()  # written bytes land before the cut
        await self._changing_pages(ino)
        try:
            attr = await self.ns.setattr(ino, user, length=length)
        finally:
            await self._changing_pages(ino)  # a read-around that read before the cut stores nothing
        self._drop_read_ahead(ino)
        self._cached.pop(ino, None)
        # later hints refer to the new truncate version, and never reach past it
        for h in self._ino_handles.get(ino, ()):
            h.written_end = min(h.written_end, length)
            h.published_end = min(h.published_end, length)
            h.attr, h.truncated = attr, True
            if h.writer is not None:
                h.writer.attr = attr
                h.writer.discard_before(length)

    @fuse_errors
    async def readlink(self, inode, ctx):
        return os.fsencode(await self.ns.readlink(inode, self.ns.user(ctx)))

    # -- namespace -------------------------------------------------------------------------------
    @fuse_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        name = decode(name)
        self.new_dirs.touch(parent_inode, name)
        rsp = await self._changing((parent_inode,), self.ns.mkdir(parent_inode, name, stat.S_IMODE(mode),
                                                                  self.ns.user(ctx)))
        entry = self._found(rsp.attr)
        self.new_dirs.made(entry.st_ino)
        return entry

    @fuse_errors
    async def unlink(self, parent_inode, name, ctx):
        name = decode(name)
        self.new_dirs.touch(parent_inode, name)
        await self.end_deferred()
        await self._changing((parent_inode,), self.ns.unlink(parent_inode, name, self.ns.user(ctx)))

    @fuse_errors
    async def rmdir(self, parent_inode, name, ctx):
        name = decode(name)
        self.new_dirs.touch(parent_inode, name)
        await self.end_deferred()
        await self._changing((parent_inode,), self.ns.rmdir(parent_inode, name, self.ns.user(ctx)),
                             everything=True)  # the directory removed is known by name only

    @fuse_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        if flags & ~pyfuse3.RENAME_NOREPLACE:  # RENAME_EXCHANGE, RENAME_WHITEOUT: not done silently
            raise pyfuse3.FUSEError(errno.EINVAL)  # meta has no atomic exchange nor whiteout devices
        self.new_dirs.touch(parent_inode_old, decode(name_old))
        self.new_dirs.touch(parent_inode_new, decode(name_new))
        await self.end_deferred()
        # the entry moved (a directory's ctime moves) and one replaced are known by name only
        await self._changing((parent_inode_old, parent_inode_new), self.ns.rename(
            parent_inode_old, decode(name_old), parent_inode_new, decode(name_new),
            bool(flags & pyfuse3.RENAME_NOREPLACE), self.ns.user(ctx)), everything=True)

    @fuse_errors
    async def symlink(self, parent_inode, name, target, ctx):
        name = decode(name)
        self.new_dirs.touch(parent_inode, name)
        rsp = await self._changing((parent_inode,), self.ns.symlink(parent_inode, name, decode(target),
                                                                    self.ns.user(ctx)))
        return self._found(rsp.attr)

    @fuse_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        """FIFOs, devices and sockets become inodes of their type; S_IFREG a regular file."""
        user, name = self.ns.user(ctx), decode(name)
        self.new_dirs.touch(parent_inode, name)
        kind = SPECIAL_OF_BITS.get(stat.S_IFMT(mode))
        if kind is None:
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
                raise pyfuse3.FUSEError(errno.EINVAL)
            rsp = await self._changing((parent_inode,), self.ns.create(
                parent_inode, name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, stat.S_IMODE(mode), user))
            attr = await self.ns.close(rsp.attr.inode, rsp.session, -1)
            return self._found(attr)
        rsp = await self._changing((parent_inode,), self.ns.mknod(parent_inode, name, kind, stat.S_IMODE(mode),
                                                                  rdev, user))
        return self._found(rsp.attr)

    # -- extended attributes ---------------------------------------------------------------------
    @fuse_errors
    async def getxattr(self, inode, name, ctx):
        name = decode(name)
        caps = name == CAPABILITY_XATTR
        if caps and self._no_caps.get(inode, 0.0) > time.monotonic():
            self.stats["capability_from_cache"] += 1
            raise pyfuse3.FUSEError(errno.ENODATA)
        try:
            rsp = await self.ns.xattr(inode, m.XATTR_GET, self.ns.user(ctx), name)
        except OSError as e:
            if caps and e.errno == errno.ENODATA:
                self._note_no_caps(inode)
            raise
        return rsp.value

    def _note_no_caps(self, ino: int) -> None:
        """The file has no security.capability (meta said so, or this daemon just created it): for as long as
        the kernel keeps attributes, its getxattr of that name before every write(2) is answered here."""
        if self.options.attr_timeout_s > 0:
            self._no_caps[ino] = time.monotonic() + self.options.attr_timeout_s

    @fuse_errors
    async def setxattr(self, inode, name, value, ctx):
        self._no_caps.pop(inode, None)
        # pyfuse3 has checked XATTR_CREATE / XATTR_REPLACE with getxattr already (not atomically)
        await self._changing((inode,), self.ns.xattr(inode, m.XATTR_SET, self.ns.user(ctx), decode(name),
                                                     bytes(value)))  # its ctime moves

    @fuse_errors
    async def listxattr(self, inode, ctx):
        rsp = await self.ns.xattr(inode, m.XATTR_LIST, self.ns.user(ctx))
        return [os.fsencode(n) for n in rsp.names]

    @fuse_errors
    async def removexattr(self, inode, name, ctx):
        self._no_caps.pop(inode, None)
        await self._changing((inode,), self.ns.xattr(inode, m.XATTR_REMOVE, self.ns.user(ctx), decode(name)))

    @fuse_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self.new_dirs.touch(new_parent_inode, decode(new_name))
        rsp = await self._changing((new_parent_inode,), self.ns.link(inode, new_parent_inode, decode(new_name),
                                                                     self.ns.user(ctx)))
        return self._found(rsp.attr)

    @fuse_errors
    async def statfs(self, ctx):
        rsp = await self.ns.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = STATFS_BLOCK_BYTES
        s.f_blocks = rsp.capacity_bytes // STATFS_BLOCK_BYTES
        s.f_bfree = s.f_bavail = rsp.free_bytes // STATFS_BLOCK_BYTES
        s.f_files = s.f_ffree = s.f_favail = 0  # inodes are not a limited resource here
        s.f_namemax = limits.NAME_BYTES_MAX
        return s

    # -- directories -----------------------------------------------------------------------------
    @fuse_errors
    async def opendir(self, inode, ctx):
        user = self.ns.user(ctx)
        attr = await self.ns.getattr(inode, user)  # ENOENT / ENOTDIR now, not at the first readdir
        self.changed.forget(inode)  # fresher than what a change of it gave
        if self.dir_cache:
            self._keep_listing(inode, attr)
        fh = next(self._fh)
        self._dirs[fh] = DirHandle(inode, user)
        return fh

    def _keep_listing(self, ino: int, attr: m.InodeAttr) -> None:
        """Close-to-open for listings the kernel caches (every opendir asks it to: fuse_fallocate.
        install_dir_cache): the cached listing stays only while the directory has the mtime and ctime it
        had at the open before it was read (meta moves them at every entry change, by any client);
        otherwise the kernel drops it, and the directory's attributes, at this open."""
        stamp = (attr.mtime_ns, attr.ctime_ns)
        before = self._listed.get(ino)
        self._listed[ino] = stamp
        if before is None or before == stamp:
            self.stats["opendir_keep" if before else "opendir_first"] += 1
            return
        try:
            pyfuse3.invalidate_inode(ino, attr_only=False)
            self.stats["opendir_drop"] += 1
        except OSError as e:  # ENOENT: the kernel has no inode: nothing cached
            log.debug("invalidating the listing of inode %d: %s", ino, e)

    @fuse_errors
    async def readdir(self, fh, start_id, token):
        self.stats["readdirs"] += 1
        d = self._dirs[fh]
        i = start_id
        while True:
            if i >= len(d.entries) or (d.more and len(d.entries) == DOT_ENTRIES):  # dots + 1st page: 1 batch
                if not d.more:
                    return
                after = d.entries[-1].name if len(d.entries) > DOT_ENTRIES else ""
                page, d.more = await self.ns.readdir_page(d.ino, after, d.user)
                d.entries.extend(page)
                continue
            if i not in d.attrs:
                await self._dir_attrs(d, i)
            attr = d.attrs[i]
            if attr is not None:  # None: removed since the listing
                if not pyfuse3.readdir_reply(token, os.fsencode(d.entries[i].name), self.entry(attr), i + 1):
                    return
                if attr.type == m.DIRECTORY:
                    self.changed.forget(to_fuse(attr.inode))  # the kernel takes these attributes too
                if i >= DOT_ENTRIES:
                    self.ns.remember(to_fuse(attr.inode))
            i += 1

    async def _dir_attrs(self, d: DirHandle, first: int) -> None:
        names = [e.name for e in d.entries[first:first + READDIR_LOOKUP_BATCH]]
        for k, attr in enumerate(await self.ns.lookup_many(d.ino, names, d.user)):
            d.attrs[first + k] = attr

    async def releasedir(self, fh):
        self.requests["releasedir"] += 1
        self._dirs.pop(fh, None)

    # -- files -----------------------------------------------------------------------------------
    def _open_handle(self, ino: int, rsp: m.OpenRsp, flags: int, ctx, direct: bool = False) -> pyfuse3.FileInfo:
        """The handle of an open (no await: what _changing_pages settled stays so until it is in place)."""
        writer = None
        seg = self._segment(rsp.attr.layout.chunk_size)
        if flags & os.O_ACCMODE != os.O_RDONLY or self.enable_writeback_cache:
            writer = WriteBehind(self.aio, rsp.attr, seg, self.options.write_behind_bytes)
            self._writers[ino] += 1
        fh = next(self._fh)
        h = self._handles[fh] = Handle(ino, rsp.attr, rsp.session, writer,
                                       ReadAhead(self.aio, self._pool, seg, self.options.read_ahead_bytes,
                                                 reader=self._reader),
                                       kill_privs=writer is not None and self.options.direct_io and ctx.uid != 0,
                                       direct=direct)
        self._ino_handles.setdefault(ino, []).append(h)
        return pyfuse3.FileInfo(fh=fh, direct_io=self.options.direct_io,
                                keep_cache=self._keep_cache(ino, rsp.attr))

    def _segment(self, chunk_size: int) -> int:
        """The stream's IO unit: whole chunks, at least options.segment_bytes (a 1 MiB kernel request is
        then a piece of a larger storage read, and a segment is one request per storage service)."""
        seg = segment_bytes(chunk_size)
        want = min(max(seg, self.options.segment_bytes), SEGMENT_BYTES_MAX)
        return max(seg, want // seg * seg)

    def _keep_cache(self, ino: int, attr: m.InodeAttr) -> bool:
        """Close-to-open: whether the kernel may keep the pages it cached of this file. Yes only when the
        file is as it was when they were cached (length, mtime, truncate version, from the fresh attr of
        this open) and nothing was written through this daemon since (writes forget the stamp). When not,
        the kernel drops the pages (FOPEN_KEEP_CACHE unset), and its attributes if they are not the ones
        of this open (a size another client changed). The pages cached from now on are of this attr."""
        stamp = (attr.length, attr.mtime_ns, attr.truncate_ver)
        if self._reported.get(ino, stamp) != stamp:
            self._reported[ino] = stamp
            try:
                pyfuse3.invalidate_inode(ino, attr_only=True)
                self.stats["attr_invalidations"] += 1
            except OSError as e:  # ENOENT: the kernel has no inode: nothing cached
                log.debug("invalidating the attributes of inode %d: %s", ino, e)
        keep = self.options.keep_cache and not self.options.direct_io and self._cached.get(ino) == stamp
        self._cached[ino] = stamp
        self.stats["opens_keep_cache" if keep else "opens_drop_cache"] += 1
        return keep

    @fuse_errors
    async def open(self, inode, flags, ctx):
        direct = bool(flags & os.O_DIRECT)
        flags &= OPEN_FLAGS_PASSED
        rsp = await self._stale_if_gone(self.ns.open(inode, flags, self.ns.user(ctx)))
        self.changed.forget(inode)  # meta's attributes as of now: fresher than any kept
        stamp = (rsp.attr.length, rsp.attr.mtime_ns, rsp.attr.truncate_ver)
        if (flags & os.O_ACCMODE != os.O_RDONLY or self.enable_writeback_cache or self._cached.get(inode) != stamp
                or self._reported.get(inode, stamp) != stamp):
            # the kernel may drop the pages at this open, or a writer comes: see _changing_pages (a
            # read-only open of a file as its pages are keeps them, and what is being stored is current)
            await self._changing_pages(inode)
        if rsp.attr.nlink == 0 and rsp.attr.type == m.FILE:
            # unlinked since the kernel cached its name (another client renamed a file over it, or
            # removed it): ESTALE has the kernel look the name up again, as NFS clients do
            if rsp.session:
                await self.ns.close(rsp.attr.inode, rsp.session, -1)
            self.stats["stale_opens"] += 1
            raise pyfuse3.FUSEError(errno.ESTALE)
        if rsp.attr.type != m.FILE:
            raise pyfuse3.FUSEError(errno.EISDIR if rsp.attr.type == m.DIRECTORY else errno.EINVAL)
        return self._open_handle(inode, rsp, flags, ctx, direct)

    @fuse_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        direct = bool(flags & os.O_DIRECT)
        flags &= OPEN_FLAGS_PASSED
        name = decode(name)
        self.new_dirs.touch(parent_inode, name)
        rsp = await self._changing((parent_inode,), self.ns.create(parent_inode, name, flags,
                                                                   stat.S_IMODE(mode), self.ns.user(ctx)))
        await self._changing_pages(to_fuse(rsp.attr.inode))
        entry = self._found(rsp.attr)
        if rsp.parents:  # this call made the file: it has no extended attributes
            self._note_no_caps(entry.st_ino)
        return self._open_handle(entry.st_ino, rsp, flags, ctx, direct), entry

    async def _changing_pages(self, ino: int) -> None:
        """The file's pages may change now (an open, a truncate): read-arounds that began before store
        nothing, and the stores already handed over are done when this returns (fuse_store)."""
        self._epoch[ino] += 1
        while self._store.busy(ino):  # (a store handed over while this waited is waited for too: the
            await self._store.settle(ino)  # caller goes on in the step of the last check, no await between)

    @fuse_errors
    async def read(self, fh, off, size):
        h = self._handles[fh]
        await self._drain_inode(h.ino)  # reads see every write this daemon took
        length = self._length(h.ino, h.attr.length)
        n = max(0, min(size, length - off))
        if n == 0:
            return b""
        self.stats["reads"] += 1
        self.stats["read_bytes"] += n
        self._reading += 1
        self.stats["reads_inflight_max"] = max(self.stats["reads_inflight_max"], self._reading)
        random = n < SMALL_READ_BYTES and off != h.read_end and not h.reader.active
        h.read_end = off + n
        try:
            # pyfuse3 copies the reply to the kernel as soon as this coroutine returns, in this same
            # event loop step; call_soon runs after that step, so buffers are reused only then.
            if random:  # a small read that continues nothing: read it alone, start no read-ahead
                self.stats["random_reads"] += 1
                around = self.options.read_around_bytes
                if (around > 0 and not h.direct and not self.options.direct_io and off % PAGE_BYTES == 0
                        and length <= self._around_file_max and not self._writers[h.ino]):
                    # (a read as large as the window is read alone, but its miss counts for the region)
                    around = self._around_window(h.ino, off, around)
                    if around > n:
                        return await self._read_around(h.ino, _with_length(h.attr, length), off, n, around)
                return await self._read_alone(_with_length(h.attr, length), off, n)
            return await h.reader.read(_with_length(h.attr, length), off, n,
                                       asyncio.get_running_loop().call_soon)
        finally:
            self._reading -= 1

    async def _read_alone(self, attr: m.InodeAttr, off: int, n: int) -> memoryview:
        lease, got = await read_leased(self._pool, self._reader, attr, off, n)
        asyncio.get_running_loop().call_soon(lease.release)
        return lease.view[:got]

    def _around_window(self, ino: int, off: int, around: int) -> int:
        """The window of a read-around miss at `off`: `around`, or the whole aligned region
        (read_around_region_bytes) when an earlier miss of this inode fell in the same region (the file is
        read densely at random: its region is read once instead of window by window)."""
        region = self.options.read_around_region_bytes
        if region <= around:
            return around
        missed = self._around_missed.get(ino)
        if missed is None:
            missed = self._around_missed[ino] = set()
        index = off // region
        if index in missed:
            self.stats["reads_around_region"] += 1
            return region
        missed.add(index)
        return around

    async def _read_around(self, ino: int, attr: m.InodeAttr, off: int, n: int, around: int) -> memoryview:
        """A buffered small read that missed the page cache: read the aligned window around it in the
        same one storage request, answer from it and store the rest of it in the kernel's page cache
        (fuse_store: the rules that keep stored pages current)."""
        self._store.reclaim()
        start = off - off % around
        end = min(max(start + around, off + n), attr.length)  # a request across two windows: to its end
        epoch = self._epoch[ino]
        lease, got = await read_leased(self._pool, self._reader, attr, start, end - start)
        reply = lease.view[off - start:min(off - start + n, got)]
        # the rest of the window goes to the page cache once the reply is in (call_soon runs after this
        # step, in which pyfuse3 sends it), so that the requested pages are no longer locked: the whole
        # window is one store (each store is a wake-up of the store thread and a take of the GIL)
        asyncio.get_running_loop().call_soon(self._store_window, ino, epoch, start, start + got, n, lease)
        return reply

    def _store_window(self, ino: int, epoch: int, start: int, end: int, n: int, lease) -> None:
        # never past what the kernel was told the length is (a store beyond it extends the kernel's)
        stop = min(end, self._reported.get(ino, (0,))[0])
        if stop - start > n and self._epoch[ino] == epoch and not self._writers[ino] and not self._store.full():
            self.stats["reads_around"] += 1
            epochs = self._epoch
            self._store.submit(ino, [(start, lease.view[:stop - start])], lease,  # released once stored
                               lambda: epochs.get(ino, 0) != epoch)
        else:
            self.stats["reads_around_not_stored"] += 1
            lease.release()

    @fuse_errors
    async def write(self, fh, off, buf):
        h = self._handles[fh]
        self.stats["writes"] += 1
        self.stats["write_bytes"] += len(buf)
        if h.writer is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        self._epoch[h.ino] += 1
        self._drop_read_ahead(h.ino)
        self._cached.pop(h.ino, None)  # the next open drops the pages: meta's stamp moves at publish
        self.changed.forget(h.ino)  # attributes kept from a setattr are older than this write
        if h.kill_privs:
            await self._kill_privs(h)
        await h.writer.write(off, buf)
        h.written_end = max(h.written_end, off + len(buf))
        return len(buf)

    async def _kill_privs(self, h: Handle) -> None:
        """A write by a user without CAP_FSETID clears set-uid, and set-gid when group-executable (the
        kernel's should_remove_suid). Through the page cache the kernel does it itself (a setattr before
        the write); with --direct-io it only flags the write (FUSE_WRITE_KILL_SUIDGID), a flag pyfuse3 does
        not pass on, so the daemon does it at the first write of each handle a user other than root opened
        (uid 0 standing for CAP_FSETID). The kernel has allowed the write: meta checks nothing again."""
        h.kill_privs = False
        mode = (await self.ns.getattr(h.ino, KERNEL_CHECKED)).mode
        kill = stat.S_ISUID | (stat.S_ISGID if mode & stat.S_IXGRP else 0)
        if mode & kill:
            await self.ns.setattr(h.ino, KERNEL_CHECKED, mode=mode & ~kill)
            self.stats["set_id_bits_cleared"] += 1
            try:
                pyfuse3.invalidate_inode(h.ino, attr_only=True)
            except OSError as e:  # ENOENT: the kernel has no inode: nothing cached
                log.debug("invalidating the attributes of inode %d: %s", h.ino, e)

    async def fallocate(self, ino: int, fh: int, mode: int, offset: int, length: int) -> None:
        """fallocate(2) (routed here by fuse_fallocate): 0 extends the size, KEEP_SIZE reserves (nothing
        to do: storage allocates on write), PUNCH_HOLE / ZERO_RANGE write zeros over the range. The kernel
        has checked the descriptor is writable and flushed its cached pages of the range."""
        h = self._handles.get(fh)
        if h is None or h.ino != ino or h.writer is None:
            h = next((x for x in self._ino_handles.get(ino, ()) if x.writer is not None), None)
        if h is None:
            raise OSError(errno.EBADF, f"fallocate: inode {ino} has no handle open for writing")
        self.changed.forget(ino)  # the size or mtime moves: attributes kept from a setattr are stale
        keep, kind = bool(mode & FALLOC_FL_KEEP_SIZE), mode & ~FALLOC_FL_KEEP_SIZE
        if kind not in (0, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE) or (kind == FALLOC_FL_PUNCH_HOLE
                                                                             and not keep):
            raise OSError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x} is not supported")
        if offset < 0 or length <= 0:
            raise OSError(errno.EINVAL, "fallocate: offset must be >= 0 and length > 0")
        end, size = offset + length, self._length(ino, h.attr.length)
        if kind:
            await self._changing_pages(ino)
            self._drop_read_ahead(ino)
            self._cached.pop(ino, None)
            for pos in range(offset, min(end, size), ZERO_PIECE_BYTES):
                await h.writer.write(pos, bytes(min(ZERO_PIECE_BYTES, min(end, size) - pos)))
            await h.writer.flush()
        if not keep and end > size:
            await self._truncate(ino, end, KERNEL_CHECKED)

    def _drop_read_ahead(self, ino: int) -> None:
        for other in self._ino_handles.get(ino, ()):
            other.reader.drop()

    async def _drain_inode(self, ino: int) -> None:
        for h in self._handles_of(ino):
            if h.writer is not None and h.writer.dirty:
                await h.writer.flush()

    async def _land(self, h: Handle) -> Exception | None:
        """Drain the handle's writes to storage; its written end becomes what was acknowledged. Returns the
        error of a write that failed (the caller publishes what landed, then raises it)."""
        err = None
        if h.writer is not None:
            try:
                await h.writer.flush()
            except Exception as e:
                err = e
            h.written_end = h.writer.acknowledged(h.written_end)
        if h.written_end > h.published_end:
            self.changed.forget(h.ino)  # its publication moves mtime and the length past what was kept
        return err

    async def _sync(self, h: Handle, end_session: bool) -> None:
        """Drain the handle's writes, then publish its length (and end its session)."""
        err = await self._land(h)
        if h.written_end > h.published_end and (h.truncated or not end_session):
            h.attr = await self.ns.sync(h.attr, h.session, h.written_end)
            h.published_end = h.written_end
        if end_session and h.session:
            hint = h.written_end if h.written_end > h.published_end else -1
            if hint < 0 and not h.truncated and err is None:
                # nothing written, or all of it published at flush: the session alone ends
                self._end_later(h.attr.inode, h.session)
            else:
                h.attr = await self.ns.close(h.attr.inode, h.session, hint)
            h.published_end = max(h.published_end, h.written_end)
        if err is not None:
            raise err

    @fuse_errors
    async def flush(self, fh):
        await self._sync(self._handles[fh], end_session=False)

    @fuse_errors
    async def fsync(self, fh, datasync):
        await self._sync(self._handles[fh], end_session=False)

    @fuse_errors
    async def release(self, fh):
        h = self._handles[fh]
        try:
            await self._sync(h, end_session=True)
        finally:
            if h.written_end >= 0:  # what it wrote keeps counting in _length once the handle is gone
                self._note_length(h.ino, h.attr.truncate_ver, max(h.written_end, h.attr.length))
            del self._handles[fh]
            same = self._ino_handles.get(h.ino, [])
            for i, other in enumerate(same):
                if other is h:  # (by identity: a dataclass's == compares fields)
                    del same[i]
                    break
            if not same:
                self._ino_handles.pop(h.ino, None)
            if h.writer is not None:
                self._writers[h.ino] -= 1
                if self._writers[h.ino] <= 0:
                    del self._writers[h.ino]
            h.reader.drop()

    async def release_all(self) -> None:
        """At unmount: end every session still open (the kernel may not send release any more)."""
        for fh in list(self._handles):
            try:
                await self.release(fh)
            except pyfuse3.FUSEError as e:
                log.warning("closing handle %s at unmount: %s", fh, os.strerror(e.errno))
        await self.end_deferred()

    # -- write sessions of files nothing was written to: ended in batches ------------------------
    def _end_later(self, inode: int, session: str) -> None:
        """As the library does (client.py, DEFERRED_CLOSE_S): closing a file opened for writing that
        nothing was written to changes nothing but its write session, so the session ends in a batch
        (meta.close_many) at most DEFERRED_CLOSE_S later, once DEFERRED_CLOSES_MAX wait, before this
        daemon's next unlink, rmdir, rename or truncate, or at unmount. A create + close through the
        mount is then a lookup and a create. So does the release of a handle whose writes all reached
        storage and were published at the last flush (close(2)): meta's close would only end the session
        (no length hint: nothing to measure), so a create + write + close is a lookup, a create and the
        flush's length (plus the kernel's security.capability getxattr at the first write)."""
        self._deferred.append(m.SessionRef(inode, session))
        self.stats["closes_deferred"] += 1
        if len(self._deferred) >= DEFERRED_CLOSES_MAX:
            self._background(self.end_deferred())
        elif self._deferred_timer is None:
            self._deferred_timer = asyncio.get_running_loop().call_later(
                DEFERRED_CLOSE_S, lambda: self._background(self.end_deferred()))

    async def end_deferred(self) -> None:
        if self._deferred_timer is not None:
            self._deferred_timer.cancel()
            self._deferred_timer = None
        refs, self._deferred = self._deferred, []
        if not refs:
            return
        try:
            try:
                await self.aio.meta_call("close_many", m.CloseManyReq(refs), m.OkRsp)
            except ThreeFSError as e:
                if e.code != StatusCode.UNKNOWN_METHOD:
                    raise
                for r in refs:  # a meta server older than close_many
                    await self.ns.close(r.inode, r.session, -1)
        except Exception as e:  # the sessions end when meta prunes this client's (docs/meta.md)
            log.warning("could not end %d write sessions: %s", len(refs), e)

    def _background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @fuse_errors
    async def access(self, inode, mode, ctx):
        return True  # default_permissions: the kernel checks the mode bits itself


class KernelQueueGate:
    """Holds reads bound for storage while the kernel still has requests queued for this daemon, so that
    concurrent kernel requests (an io_depth of 32) reach storage as one batch. pyfuse3 takes one request
    per loop turn or so; the gate polls /dev/fuse each turn and lets the held reads go when nothing is
    queued, when batch_max are held, or when no read joined for GATE_IDLE_TURNS turns (what is
    queued is not a read). A lone read (`lone`: nothing held, nothing queued) goes at once.

    A batch_max below the kernel's reads in flight would keep two batches in flight (one at storage while
    the next gathers); measured at fio qd32 (one cluster, three daemons, interleaved 4 s runs, load 7-9):
    64 gave 4.6k / 1.9k / 2.8k IO/s, 16 gave 5.5k / 2.3k / 2.0k, 8 gave 0.9k / 2.9k / 4.1k: no gain above
    the noise, and smaller batches cost more CPU per read (daemon 79-116 us at 64, 92-134 at 16; storage
    30-37 against 39-48), so the default holds them all (`--gate-batch` to try others)."""

    def __init__(self, fd: int, batch_max: int = 64):
        self._batch_max = max(1, batch_max)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._waiters: list[asyncio.Future] = []
        self._seen = self._idle = self._turns = 0
        self.batches = self.held = 0

    def lone(self) -> bool:
        """Whether a read may go at once: none is held here and the kernel has no request queued for this
        daemon, so no other read can join it (the requests pyfuse3 took are in their handlers already, held
        here or gone on). Counted as a gate opening of one read."""
        if self._waiters or self._poll.poll(0):
            return False
        self.batches += 1
        self.held += 1
        return True

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._waiters:
            self._seen = self._idle = self._turns = 0
            loop.call_soon(self._check)
        self._waiters.append(fut)
        await fut

    def _check(self) -> None:
        n = len(self._waiters)
        self._idle = 0 if n > self._seen else self._idle + 1
        self._seen = n
        self._turns += 1
        queued = bool(self._poll.poll(0))
        if queued and n < self._batch_max and self._idle < GATE_IDLE_TURNS and self._turns < GATE_TURNS_MAX:
            asyncio.get_running_loop().call_soon(self._check)
            return
        waiters, self._waiters = self._waiters, []
        self.batches += 1
        self.held += len(waiters)
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


class _GatedReader:
    """What ReadAhead reads through: the gate, then the coalescer (one storage batch per gate opening)."""

    def __init__(self, ops: ThreeFSOperations):
        self._ops = ops

    async def read_into(self, attr: m.InodeAttr, offset: int, dest: memoryview) -> int:
        gate = self._ops._gate
        if gate is not None:
            if gate.lone():  # a lone read (queue depth 1): no loop turns waiting for others
                return await self._ops._coalescer.read_into(attr, offset, dest, alone=True)
            await gate.wait()
        return await self._ops._coalescer.read_into(attr, offset, dest)


def _with_length(a: m.InodeAttr, length: int) -> m.InodeAttr:
    return a if length == a.length else msgspec.structs.replace(a, length=length)


__all__ = ["FUSE_ROOT", "MountOptions", "ThreeFSOperations"]
