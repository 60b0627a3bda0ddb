"""S3 keys <-> threefs paths: a reversible mapping (pure functions, no IO).

A bucket is a directory `ROOT/BUCKET`; an object is a file. The key is split at `/`; every segment but
the last is a directory, the last is the file. A segment that is a valid plain POSIX name of at most
`PLAIN_BYTES_MAX` bytes, is not `.`/`..`/empty and does not start with `%`, is used as it is, so
`photos/2024/a.jpg` is the file `BUCKET/photos/2024/a.jpg` that FUSE and the CLI show.

Every other segment is written in one of the escaped forms (all start with `%`, which plain names
never do):

    %%rest    the segment `%rest` (a segment that itself starts with `%`)
    %e        the empty segment (`a//b`, `a/` = a "folder marker" object)
    %d, %dd   the segments `.` and `..`
    %cPIECE   the first PIECE (<= PLAIN_BYTES_MAX bytes, cut at a character boundary) of a longer
              segment, as a directory; the rest of the segment follows inside it (no `/` between)
    %oNAME    the object whose final component is NAME while NAME is also a directory (key `a`
              beside keys `a/...`): the object lives beside the directory under this name

Decoding inverts each form; a name that starts with `%` but matches none of them (made outside the
gateway) is read as the literal name.
"""

from __future__ import annotations

import re

from threefs.s3.errors import S3Error

PLAIN_BYTES_MAX = 200  # leaves room for the escape prefixes below NAME_BYTES_MAX (255)
KEY_BYTES_MAX = 1024  # S3's limit
BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")

ALT_PREFIX = "%o"
CONT_PREFIX = "%c"


def check_bucket_name(name: str) -> None:
    if not BUCKET_RE.match(name) or ".." in name or re.match(r"^\d+\.\d+\.\d+\.\d+$", name):
        raise S3Error("InvalidBucketName", f"bucket name {name!r} is not valid: 3-63 characters of "
                      "lower-case letters, digits, '.' and '-', starting and ending with a letter or digit")


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def _encode_short(seg: str) -> str:
    if seg == "":
        return "%e"
    if seg == ".":
        return "%d"
    if seg == "..":
        return "%dd"
    if seg.startswith("%"):
        return "%" + seg
    return seg


def _cut(seg: str) -> tuple[str, str]:
    """The longest prefix of at most PLAIN_BYTES_MAX UTF-8 bytes, and the rest."""
    raw = seg.encode("utf-8", "surrogatepass")
    end = PLAIN_BYTES_MAX
    while end > 0 and (raw[end] & 0xC0) == 0x80:  # never cut inside a character
        end -= 1
    return raw[:end].decode("utf-8", "surrogatepass"), raw[end:].decode("utf-8", "surrogatepass")


def encode_segment(seg: str) -> list[str]:
    """One key segment -> its path components: one name, or continuation directories then a name."""
    names = []
    # a "%"-segment grows by one byte when escaped, so cut one byte earlier for those
    while _utf8_len(seg) > PLAIN_BYTES_MAX - (1 if seg.startswith("%") else 0):
        piece, seg = _cut(seg)
        names.append(CONT_PREFIX + piece)
    names.append(_encode_short(seg))
    return names


def check_key(key: str) -> None:
    if key == "":
        raise S3Error("InvalidArgument", "the object key is empty")
    if "\x00" in key:
        raise S3Error("InvalidArgument", "object keys may not contain NUL")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise S3Error("InvalidURI", "couldn't parse the specified URI: the key is not valid UTF-8") from None
    if _utf8_len(key) > KEY_BYTES_MAX:
        raise S3Error("KeyTooLongError", f"the key is {_utf8_len(key)} bytes; at most {KEY_BYTES_MAX}")


def key_components(key: str) -> tuple[list[str], str]:
    """key -> (directory components under the bucket, final file name)."""
    check_key(key)
    segments = key.split("/")
    comps: list[str] = []
    for seg in segments[:-1]:
        comps.extend(encode_segment(seg))
    last = encode_segment(segments[-1])
    comps.extend(last[:-1])
    return comps, last[-1]


def decode_name(name: str) -> tuple[str, str]:
    """A directory entry's name -> (kind, text): kind "seg" (a whole segment), "cont" (a piece of a
    segment that goes on inside the directory) or "alt" (an object's final segment, `%o` form)."""
    if name.startswith(ALT_PREFIX):
        return "alt", decode_name(name[len(ALT_PREFIX):])[1]
    if name.startswith(CONT_PREFIX):
        return "cont", name[len(CONT_PREFIX):]
    if name.startswith("%%"):
        return "seg", name[1:]
    return "seg", {"%e": "", "%d": ".", "%dd": ".."}.get(name, name)


def entry_key(prefix: str, name: str, is_dir: bool) -> tuple[str, bool]:
    """The key text an entry contributes after its directory's key prefix: (text, exact) where
    exact means the entry is an object whose key is exactly the text (a file); for a directory the
    text is a lower bound (and a prefix) of every key inside it."""
    kind, text = decode_name(name)
    if is_dir:
        return prefix + text + ("" if kind == "cont" else "/"), False
    return prefix + text, True
