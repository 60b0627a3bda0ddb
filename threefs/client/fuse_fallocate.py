"""fallocate(2) for the FUSE daemon, which pyfuse3 does not pass on (its libfuse operation table leaves the
slot empty, so the kernel would answer EOPNOTSUPP); and the connection limits pyfuse3's INIT handler does
not let a file system set (`install_init`: max_background, congestion_threshold), and the session's
/dev/fuse descriptor (`session_fd`).

`install(ops)`, called right after `pyfuse3.init`, fills that slot in the session's copy of the table
(libfuse dispatches on it per request): a ctypes callback that hands each request to
`ops.fallocate(ino, fh, mode, offset, length)` on the daemon's event loop and replies with libfuse's
`fuse_reply_err` when it is done. pyfuse3's own table and session pointer are found through its ELF symbol
table; the table is checked against the slots pyfuse3 is known to fill (readdirplus set, readdir not, ...)
and its copy is located in the session by its exact contents. If anything does not match, nothing is
changed, a warning says why, and fallocate stays EOPNOTSUPP.

Modes (ext4's, ops.fallocate): 0 reserves and extends the size; FALLOC_FL_KEEP_SIZE reserves only (a
no-op: storage allocates on write); PUNCH_HOLE|KEEP_SIZE and ZERO_RANGE write zeros over the range
(chunks are not deallocated); the others are EOPNOTSUPP.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import struct

log = logging.getLogger(__name__)

OPS_SYMBOL = b"__pyx_v_7pyfuse3_fuse_ops"
SESSION_SYMBOL = b"__pyx_v_7pyfuse3_session"
SESSION_SCAN_BYTES = 512  # the operation table sits near the start of libfuse's struct fuse_session
SLOTS = 42  # the first pointers of struct fuse_lowlevel_ops (libfuse 3.x, fuse_lowlevel.h): up to readdirplus
SLOT_INIT, SLOT_LOOKUP, SLOT_READDIR, SLOT_WRITE_BUF, SLOT_FALLOCATE, SLOT_READDIRPLUS = 0, 2, 21, 36, 40, 41
FILE_INFO_FH_OFFSET = 16  # struct fuse_file_info: int flags, two 32-bit bitfield words, then uint64 fh

FALLOCATE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_void_p)
INIT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
PY_INIT_FN = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)  # pyfuse3's handler: keeps the GIL
_installed: list = []  # the callback must live as long as the session


class ConnInfo(ctypes.Structure):
    """libfuse 3's struct fuse_conn_info (fuse_common.h): what INIT negotiates."""

    _fields_ = [(name, ctypes.c_uint) for name in (
        "proto_major", "proto_minor", "max_write", "max_read", "max_readahead", "capable", "want",
        "max_background", "congestion_threshold", "time_gran")] + [("reserved", ctypes.c_uint * 22)]


def _symbol_offsets(path: str, names: list[bytes]) -> dict[bytes, int]:
    """st_value of symbols in an ELF64 file's .symtab (local symbols are not in the dynamic table)."""
    with open(path, "rb") as f:
        data = f.read()
    found: dict[bytes, int] = {}
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return found
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        for off in range(sh[4], sh[4] + sh[5], 24):
            st_name, _, _, _, st_value, _ = struct.unpack_from("<IBBHQQ", data, off)
            start = strtab[4] + st_name
            end = data.index(b"\0", start)
            if data[start:end] in names:
                found[data[start:end]] = st_value
    return found


def _load_base(path: str) -> int | None:
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    return None


_tables: dict[int, object] = {}  # session pointer -> its table (found once: installing changes its contents)


def _ops_table():
    import pyfuse3

    so = pyfuse3.__file__
    offsets, base = _symbol_offsets(so, [OPS_SYMBOL, SESSION_SYMBOL]), _load_base(so)
    if len(offsets) != 2 or base is None:
        return None, f"{OPS_SYMBOL.decode()} or {SESSION_SYMBOL.decode()} not found in {so}"
    table = (ctypes.c_void_p * SLOTS).from_address(base + offsets[OPS_SYMBOL])
    expected = (table[SLOT_LOOKUP] and table[SLOT_WRITE_BUF] and table[SLOT_READDIRPLUS]
                and not table[SLOT_READDIR] and not table[SLOT_FALLOCATE])
    if not expected:
        return None, f"pyfuse3's operation table in {so} does not have the expected layout"
    session = ctypes.c_void_p.from_address(base + offsets[SESSION_SYMBOL]).value
    if not session:
        return None, "pyfuse3 has no session yet (install after pyfuse3.init)"
    if session in _tables:
        return _tables[session], ""
    wanted = ctypes.string_at(ctypes.addressof(table), SLOTS * 8)
    memory = ctypes.string_at(session, SESSION_SCAN_BYTES + len(wanted))
    at = memory.find(wanted)
    if at < 0 or at % 8 or memory.find(wanted, at + 8) >= 0:
        return None, "the operation table's copy in libfuse's session was not found"
    _tables.clear()  # an earlier session's table is gone with it
    _tables[session] = (ctypes.c_void_p * SLOTS).from_address(session + at)
    return _tables[session], ""


def install(ops) -> bool:
    """Route the kernel's fallocate requests to `ops.fallocate` (call right after pyfuse3.init)."""
    try:
        table, why = _ops_table()
        libfuse = ctypes.CDLL("libfuse3.so.3")
    except (OSError, ImportError, struct.error, ValueError) as e:
        table, why = None, str(e)
    if table is None:
        log.warning("fallocate stays unsupported on this mount: %s", why)
        return False
    reply = libfuse.fuse_reply_err
    reply.argtypes, reply.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    loop = asyncio.get_running_loop()

    async def serve(req: int, ino: int, fh: int, mode: int, offset: int, length: int) -> None:
        err = 0
        try:
            await ops.fallocate(ino, fh, mode, offset, length)
        except OSError as e:
            err = e.errno or errno.EIO
        except Exception:
            log.exception("fallocate of inode %d failed", ino)
            err = errno.EIO
        reply(req, err)

    pending: set[asyncio.Task] = set()  # the requests being served (each replies exactly once)

    def start(req: int, ino: int, fh: int, mode: int, offset: int, length: int) -> None:
        task = asyncio.ensure_future(serve(req, ino, fh, mode, offset, length))
        pending.add(task)
        task.add_done_callback(pending.discard)

    def callback(req, ino, mode, offset, length, fi):
        try:
            fh = ctypes.c_uint64.from_address(fi + FILE_INFO_FH_OFFSET).value if fi else 0
            loop.call_soon_threadsafe(start, req, ino, fh, mode, offset, length)
        except Exception:  # never raise into libfuse
            log.exception("fallocate request lost")
            reply(req, errno.EIO)

    fn = FALLOCATE_FN(callback)
    _installed.append((fn, pending))
    table[SLOT_FALLOCATE] = ctypes.cast(fn, ctypes.c_void_p).value
    return True


def _session_pointer() -> int | None:
    import pyfuse3

    so = pyfuse3.__file__
    offsets, base = _symbol_offsets(so, [SESSION_SYMBOL]), _load_base(so)
    if SESSION_SYMBOL not in offsets or base is None:
        return None
    return ctypes.c_void_p.from_address(base + offsets[SESSION_SYMBOL]).value or None


def session_fd() -> int:
    """The /dev/fuse descriptor of pyfuse3's session (-1 if it cannot be found)."""
    try:
        session = _session_pointer()
        if session is None:
            return -1
        fn = ctypes.CDLL("libfuse3.so.3").fuse_session_fd
        fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
        return fn(session)
    except (OSError, ImportError, struct.error, ValueError) as e:
        log.warning("the FUSE session's descriptor was not found: %s", e)
        return -1


def install_init(max_background: int, congestion_threshold: int, negotiated: dict) -> bool:
    """Wrap pyfuse3's INIT handler (call right after pyfuse3.init, before the kernel's INIT arrives): it
    runs as before, then raises the kernel's limit of background requests (asynchronous direct IO and
    read-ahead; the kernel's default is 12, which caps an io_depth of 32 at 12 in flight). What was
    negotiated is copied into `negotiated` (max_write, max_readahead, want, ...)."""
    try:
        table, why = _ops_table()
    except (OSError, ImportError, struct.error, ValueError) as e:
        table, why = None, str(e)
    if table is None or not table[SLOT_INIT]:
        log.warning("the mount keeps the kernel's default request limits: %s", why or "no INIT handler")
        return False
    original = PY_INIT_FN(table[SLOT_INIT])

    def callback(userdata, conn):
        try:
            original(userdata, conn)
        finally:
            try:
                info = ConnInfo.from_address(conn)
                if max_background > 0:
                    info.max_background = max_background
                    info.congestion_threshold = max(1, min(congestion_threshold, max_background))
                negotiated.update({name: getattr(info, name) for name, _ in ConnInfo._fields_[:10]})
            except Exception:  # never raise into libfuse
                log.exception("tuning the FUSE connection failed")

    fn = INIT_FN(callback)
    _installed.append((fn, original))
    table[SLOT_INIT] = ctypes.cast(fn, ctypes.c_void_p).value
    return True


SLOT_OPEN, SLOT_OPENDIR = 14, 20
FILE_INFO_BITS_OFFSET = 4  # struct fuse_file_info: int flags, then the bitfield word
# libfuse 3.10-3.14: writepage, direct_io, keep_cache, flush, nonseekable, flock_release, cache_readdir, noflush
FI_KEEP_CACHE, FI_CACHE_READDIR, FI_NOFLUSH = 1 << 2, 1 << 6, 1 << 7
NOFLUSH_LIBFUSE_VERSIONS = range(310, 315)  # where noflush is that bit (fuse_version())
DIR_CACHE_LIBFUSE_VERSIONS = range(305, 315)  # where those bits are known to sit (fuse_version())
OPENDIR_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)
PY_OPENDIR_FN = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p)


def install_dir_cache() -> bool:
    """Have every opendir reply ask the kernel to cache the directory's listing (FOPEN_CACHE_DIR) and keep
    it across opens (FOPEN_KEEP_CACHE), which pyfuse3 cannot set: its opendir handler copies the request's
    fuse_file_info into its reply, so the wrapper sets the two bits before calling it. The daemon's opendir
    drops the kernel's cached listing (pyfuse3.invalidate_inode) when the directory changed since it was
    cached (fuse.ThreeFSOperations.opendir); the kernel drops it itself on changes made through the mount
    and when a getattr brings a new mtime. False (nothing changed) where the layout is not known."""
    return _set_reply_bits(SLOT_OPENDIR, DIR_CACHE_LIBFUSE_VERSIONS, lambda flags: FI_KEEP_CACHE | FI_CACHE_READDIR,
                           "directory listings are not cached by the kernel on this mount")


def install_open_noflush() -> bool:
    """Have the reply to every read-only open carry FOPEN_NOFLUSH, which pyfuse3 cannot set: the kernel then
    sends no FLUSH when such a file is closed (a round trip to the daemon per close(2) that had nothing to
    do: nothing was written through the handle, and this daemon keeps no locks of its own). pyfuse3's open
    handler copies the request's fuse_file_info into its reply and sets only its own fields, so the wrapper
    sets the bit before calling it, for requests whose flags say O_RDONLY. False (nothing changed) where
    the layout is not known."""
    return _set_reply_bits(SLOT_OPEN, NOFLUSH_LIBFUSE_VERSIONS,
                           lambda flags: FI_NOFLUSH if flags & os.O_ACCMODE == os.O_RDONLY else 0,
                           "closing a file opened read-only costs a FLUSH request on this mount")


def _set_reply_bits(slot: int, versions: range, bits_for, unavailable: str) -> bool:
    """Wrap the (req, ino, fi) handler in `slot` (open, opendir) so that the request's fuse_file_info gets
    `bits_for(its open flags)` set in its bitfield word before pyfuse3's handler copies it into the reply.
    False, with a warning starting `unavailable`, where the table or the layout (libfuse `versions`) is not
    known."""
    try:
        table, why = _ops_table()
        version = ctypes.CDLL("libfuse3.so.3").fuse_version()
    except (OSError, ImportError, struct.error, ValueError, AttributeError) as e:
        table, why, version = None, str(e), 0
    if table is not None and version not in versions:
        table, why = None, f"libfuse {version // 100}.{version % 100}'s fuse_file_info layout is not known here"
    if table is None or not table[slot]:
        log.warning("%s: %s", unavailable, why or f"no handler in slot {slot}")
        return False
    original = PY_OPENDIR_FN(table[slot])  # open and opendir share the signature (req, ino, fi)

    def callback(req, ino, fi):
        try:
            if fi:
                bits = bits_for(ctypes.c_int32.from_address(fi).value)
                if bits:
                    ctypes.c_uint32.from_address(fi + FILE_INFO_BITS_OFFSET).value |= bits
        except Exception:  # never raise into libfuse
            log.exception("setting reply bits in slot %d failed", slot)
        original(req, ino, fi)

    fn = OPENDIR_FN(callback)
    _installed.append((fn, original))
    table[slot] = ctypes.cast(fn, ctypes.c_void_p).value
    return True
