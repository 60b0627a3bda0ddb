"""Path parsing for the meta service: pure, no KV.

A path is split the way Linux's path walk sees it: the components leading to the parent directory, then the
last component and its kind. The kind matters because Linux answers differently when the last component is
not a plain name: `rmdir("/a/.")` is EINVAL, `rmdir("/a/..")` ENOTEMPTY, `rmdir("/")` EBUSY, `mkdir("/a/.")`
EEXIST, `unlink("/a/..")` EISDIR, `rename` of any of them EBUSY. A trailing slash demands a directory.

'.' components are dropped here; '..' is kept, because it means the *physical* parent of the directory
reached so far (the walk resolves it), not a textual cut.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from threefs.common import limits
from threefs.common.ids import INODE_MAX, ROOT_INODE
from threefs.common.status import StatusCode, status_error
from threefs.rpc.schemas.meta import NO_PARENT


class Last(enum.Enum):
    """What the last component of a path is (Linux: LAST_NORM, LAST_DOT, LAST_DOTDOT, LAST_ROOT), plus SELF:
    the empty path relative to an inode, which names that inode (FUSE's getattr(inode), open(inode))."""

    NAME = "name"
    DOT = "."
    DOTDOT = ".."
    ROOT = "/"
    SELF = ""


class ParsedPath(NamedTuple):
    text: str  # the path as the caller gave it, for error messages
    parent: tuple[str, ...]  # components to walk from `start` to the directory holding `last` ('..' allowed)
    last: str  # the final name; '' for the root and SELF, '.' or '..' for those kinds
    kind: Last
    trailing_slash: bool  # "a/b/": the target must be a directory
    start: int = ROOT_INODE  # the inode the walk starts from: the root for absolute paths

    @property
    def relative(self) -> bool:
        return not self.text.startswith("/")


def encode_name(name: str) -> bytes:
    """A name's bytes. surrogateescape lets names that are not valid UTF-8 (from FUSE) round-trip."""
    return name.encode("utf-8", "surrogateescape")


def decode_name(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def check_name(name: str, path: str) -> None:
    """Reject a single component that could never be stored (too long, NUL, '/')."""
    if "\x00" in name:
        raise status_error(StatusCode.INVALID_PATH, f"path {path!r} contains a NUL byte")
    if "/" in name or name in ("", ".", ".."):
        raise status_error(StatusCode.INVALID_PATH, f"{name!r} is not a valid file name (in {path!r})")
    size = len(encode_name(name))
    if size > limits.NAME_BYTES_MAX:
        raise status_error(
            StatusCode.NAME_TOO_LONG,
            f"name {name[:40]!r}... is {size} bytes, over the limit of {limits.NAME_BYTES_MAX} (in {path!r})",
        )


def split_components(path: str) -> list[str]:
    """Components of `path` with '//' collapsed and '.' dropped ('..' kept). No validation."""
    return [part for part in path.split("/") if part and part != "."]


def parse_path(path: str, parent: int = NO_PARENT) -> ParsedPath:
    """Validate a path and split it into (parent components, last component, kind).

    With `parent` NO_PARENT the path must be absolute; with an inode id a relative path starts there (an
    absolute one still starts at the root, as openat(2)), and "" names that inode itself."""
    if not isinstance(path, str):
        raise status_error(StatusCode.INVALID_PATH, f"path must be a str, not {type(path).__name__}")
    if not path.startswith("/"):
        if parent == NO_PARENT:
            raise status_error(StatusCode.INVALID_PATH,
                               f"path {path!r} is not absolute (must start with '/')")
        if not 0 <= parent <= INODE_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"parent inode {parent} is out of range")
    # UTF-8 takes at most 4 bytes a character: a shorter text cannot be over a byte limit, and is not encoded.
    if len(path) * 4 > limits.PATH_BYTES_MAX:
        size = len(encode_name(path))
        if size > limits.PATH_BYTES_MAX:
            raise status_error(
                StatusCode.NAME_TOO_LONG, f"path {path[:60]!r}... is {size} bytes, over the limit of "
                f"{limits.PATH_BYTES_MAX}"
            )
    raw = [part for part in path.split("/") if part]
    parts = [part for part in raw if part != "."]
    if len(parts) > limits.PATH_DEPTH_MAX:
        raise status_error(
            StatusCode.NAME_TOO_LONG, f"path {path[:60]!r}... has {len(parts)} components, over the limit of "
            f"{limits.PATH_DEPTH_MAX}"
        )
    if parts and ("\x00" in path or max(map(len, parts)) * 4 > limits.NAME_BYTES_MAX):
        for part in parts:  # some name may be invalid: each checked, in order (the first error is raised)
            if part != "..":
                check_name(part, path)
    trailing_slash = path.endswith("/") and bool(raw)
    components, last, kind = _last_of(raw, parts)
    if path.startswith("/"):
        return ParsedPath(path, components, last, kind, trailing_slash)
    if kind is Last.ROOT:  # "" relative to an inode: the inode itself
        kind = Last.SELF
    return ParsedPath(path, components, last, kind, trailing_slash, parent)


def display(parsed: ParsedPath) -> str:
    """How errors name a path: as given, or `<inode N>/rest` for one relative to an inode."""
    if not parsed.relative:
        return parsed.text
    return f"<inode {parsed.start}>" + (f"/{parsed.text}" if parsed.text else "")


def split_last(path: str) -> tuple[tuple[str, ...], str, Last]:
    """(components before the last, the last one, its kind); '//' collapsed, '.' dropped except at the end.

    Also used for symlink targets, which are never empty (an empty path has no meaning here)."""
    raw = [part for part in path.split("/") if part]
    return _last_of(raw, [part for part in raw if part != "."])


def _last_of(raw: list[str], parts: list[str]) -> tuple[tuple[str, ...], str, Last]:
    """split_last's answer from a path's non-empty components (`raw`) and those without '.' (`parts`)."""
    if not raw:
        return (), "", Last.ROOT
    last = raw[-1]
    if last == ".":
        return tuple(parts), last, Last.DOT
    return tuple(parts[:-1]), last, Last.DOTDOT if last == ".." else Last.NAME