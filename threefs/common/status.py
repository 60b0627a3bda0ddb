"""Typed status codes and the exceptions they become.

Every error that crosses a process boundary travels as a (code, message) pair in the RPC
header and is turned back into the matching exception class on the caller's side, so a
`FileNotFoundError` raised by meta arrives in the client as a `FileNotFoundError` too.
All threefs errors are `OSError`s with a meaningful errno, which is what FUSE, shutil and
fsspec users expect.
"""

from __future__ import annotations

import errno as _errno
from enum import IntEnum


class StatusCode(IntEnum):
    OK = 0
    # generic / transport (1xx)
    INVALID_ARGUMENT = 100
    TIMEOUT = 101
    NOT_IMPLEMENTED = 102
    INTERNAL = 103
    UNAVAILABLE = 104  # peer unreachable, connection lost
    AUTH_FAILED = 105
    FRAME_TOO_LARGE = 106
    UNKNOWN_METHOD = 107
    TOO_MANY_REQUESTS = 108
    PROTOCOL_ERROR = 109
    CANCELLED = 110
    # kv (2xx)
    KV_CONFLICT = 200
    KV_TOO_OLD = 201
    KV_TOO_LARGE = 202
    KV_ERROR = 203
    # mgmtd / routing (3xx)
    NOT_PRIMARY = 300
    NODE_NOT_FOUND = 301
    CHAIN_NOT_FOUND = 302
    CHAIN_TABLE_NOT_FOUND = 303
    NO_SERVING_TARGET = 304
    NOT_ENOUGH_NODES = 305
    # meta / namespace (4xx), each maps to a POSIX errno
    NOT_FOUND = 400
    EXISTS = 401
    NOT_DIRECTORY = 402
    IS_DIRECTORY = 403
    NOT_EMPTY = 404
    PERMISSION_DENIED = 405
    NAME_TOO_LONG = 406
    INVALID_PATH = 407
    TOO_MANY_SYMLINKS = 408
    BUSY = 409
    NOT_SUPPORTED = 410
    BAD_FILE_HANDLE = 411
    FILE_TOO_LARGE = 412
    NOT_PERMITTED = 413  # EPERM: not the owner (chmod, sticky directories, hard link to a directory)
    TOO_MANY_LINKS = 414  # EMLINK: a file's hard-link count is at its limit
    NO_ATTRIBUTE = 415  # ENODATA: no extended attribute of that name
    OUT_OF_RANGE = 416  # ERANGE: an extended attribute's name is too long
    VALUE_TOO_LARGE = 417  # E2BIG: an extended attribute's value is over the limit
    # storage (5xx)
    CHAIN_VERSION_MISMATCH = 500
    NOT_HEAD = 501
    CHUNK_NOT_COMMIT = 502
    CHUNK_NOT_FOUND = 503
    CHECKSUM_MISMATCH = 504
    TARGET_OFFLINE = 505
    NO_SPACE = 506
    STALE_UPDATE = 507
    MISSING_UPDATE = 508
    ADVANCE_UPDATE = 509
    TARGET_NOT_FOUND = 510
    CHUNK_LOCKED = 511
    IO_ERROR = 512


_ERRNO = {
    StatusCode.INVALID_ARGUMENT: _errno.EINVAL,
    StatusCode.TIMEOUT: _errno.ETIMEDOUT,
    StatusCode.NOT_IMPLEMENTED: _errno.ENOSYS,
    StatusCode.UNAVAILABLE: _errno.EHOSTUNREACH,
    StatusCode.AUTH_FAILED: _errno.EACCES,
    StatusCode.FRAME_TOO_LARGE: _errno.EMSGSIZE,
    StatusCode.TOO_MANY_REQUESTS: _errno.EAGAIN,
    StatusCode.CANCELLED: _errno.ECANCELED,
    StatusCode.KV_CONFLICT: _errno.EAGAIN,
    StatusCode.KV_TOO_OLD: _errno.EAGAIN,
    StatusCode.KV_TOO_LARGE: _errno.E2BIG,
    StatusCode.NOT_FOUND: _errno.ENOENT,
    StatusCode.EXISTS: _errno.EEXIST,
    StatusCode.NOT_DIRECTORY: _errno.ENOTDIR,
    StatusCode.IS_DIRECTORY: _errno.EISDIR,
    StatusCode.NOT_EMPTY: _errno.ENOTEMPTY,
    StatusCode.PERMISSION_DENIED: _errno.EACCES,
    StatusCode.NAME_TOO_LONG: _errno.ENAMETOOLONG,
    StatusCode.INVALID_PATH: _errno.EINVAL,
    StatusCode.TOO_MANY_SYMLINKS: _errno.ELOOP,
    StatusCode.BUSY: _errno.EBUSY,
    StatusCode.NOT_SUPPORTED: _errno.EOPNOTSUPP,
    StatusCode.BAD_FILE_HANDLE: _errno.EBADF,
    StatusCode.FILE_TOO_LARGE: _errno.EFBIG,
    StatusCode.NOT_PERMITTED: _errno.EPERM,
    StatusCode.TOO_MANY_LINKS: _errno.EMLINK,
    StatusCode.NO_ATTRIBUTE: _errno.ENODATA,
    StatusCode.OUT_OF_RANGE: _errno.ERANGE,
    StatusCode.VALUE_TOO_LARGE: _errno.E2BIG,
    StatusCode.NO_SPACE: _errno.ENOSPC,
    StatusCode.CHECKSUM_MISMATCH: _errno.EIO,
    StatusCode.IO_ERROR: _errno.EIO,
}

# Codes a caller may retry after refreshing routing or waiting briefly.
RETRYABLE = frozenset(
    {
        StatusCode.TIMEOUT,
        StatusCode.UNAVAILABLE,
        StatusCode.TOO_MANY_REQUESTS,
        StatusCode.KV_CONFLICT,
        StatusCode.KV_TOO_OLD,
        StatusCode.NOT_PRIMARY,
        StatusCode.NO_SERVING_TARGET,
        StatusCode.CHAIN_VERSION_MISMATCH,
        StatusCode.NOT_HEAD,
        StatusCode.CHUNK_NOT_COMMIT,
        StatusCode.TARGET_OFFLINE,
        StatusCode.CHUNK_LOCKED,
    }
)


class ThreeFSError(OSError):
    """Base of every threefs error: carries a StatusCode and a human-readable message."""

    def __init__(self, code: StatusCode | int, message: str = ""):
        code = StatusCode(code)
        self.code = code
        self.message = message or code.name.lower().replace("_", " ")
        super().__init__(_ERRNO.get(code, _errno.EIO), self.message)

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE

    def __str__(self) -> str:
        return f"[{self.code.name}] {self.message}"

    def __reduce__(self):  # keep pickling (multiprocessing) working with our signature
        return (status_error, (int(self.code), self.message))


class NotFoundError(ThreeFSError, FileNotFoundError):
    pass


class ExistsError(ThreeFSError, FileExistsError):
    pass


class NotADirectoryError_(ThreeFSError, NotADirectoryError):
    pass


class IsADirectoryError_(ThreeFSError, IsADirectoryError):
    pass


class PermissionError_(ThreeFSError, PermissionError):
    pass


class TimeoutError_(ThreeFSError, TimeoutError):
    pass


class UnavailableError(ThreeFSError, ConnectionError):
    pass


class KVConflictError(ThreeFSError):
    pass


_CLASSES: dict[StatusCode, type[ThreeFSError]] = {
    StatusCode.NOT_FOUND: NotFoundError,
    StatusCode.EXISTS: ExistsError,
    StatusCode.NOT_DIRECTORY: NotADirectoryError_,
    StatusCode.IS_DIRECTORY: IsADirectoryError_,
    StatusCode.PERMISSION_DENIED: PermissionError_,
    StatusCode.NOT_PERMITTED: PermissionError_,
    StatusCode.AUTH_FAILED: PermissionError_,
    StatusCode.TIMEOUT: TimeoutError_,
    StatusCode.UNAVAILABLE: UnavailableError,
    StatusCode.KV_CONFLICT: KVConflictError,
}


def status_error(code: StatusCode | int, message: str = "") -> ThreeFSError:
    """Build the exception for `code` (the right subclass, so `except FileNotFoundError` works)."""
    try:
        code = StatusCode(code)
    except ValueError:
        return ThreeFSError(StatusCode.INTERNAL, f"unknown status code {code}: {message}")
    return _CLASSES.get(code, ThreeFSError)(code, message)


def errno_of(exc: BaseException) -> int:
    """The errno to report for any exception (EIO when there is none)."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    return _errno.EIO
