"""fallocate(2) for the FUSE daemon, which pyfuse3 does not pass on (its libfuse operation table leaves the
slot empty, so the kernel would answer EOPNOTSUPP).

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
SLOT_LOOKUP, SLOT_READDIR, SLOT_WRITE_BUF, SLOT_FALLOCATE, SLOT_READDIRPLUS = 2, 21, 36, 40, 41
FILE_INFO_FH_OFFSET = 16  # struct fuse_file_info: int flags, two 32-bit bitfield words, then uint64 fh

FALLOCATE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64,
                                ctypes.c_int64, ctypes.c_void_p)
_installed: list = []  # the callback must live as long as the session


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
    wanted = ctypes.string_at(ctypes.addressof(table), SLOTS * 8)
    memory = ctypes.string_at(session, SESSION_SCAN_BYTES + len(wanted))
    at = memory.find(wanted)
    if at < 0 or at % 8 or memory.find(wanted, at + 8) >= 0:
        return None, "the operation table's copy in libfuse's session was not found"
    return (ctypes.c_void_p * SLOTS).from_address(session + at), ""


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
