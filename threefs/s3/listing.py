"""ListObjects: keys in S3's order (UTF-8 byte order) from a directory tree, lazily.

A best-first walk: a heap holds files (their exact key) and not-yet-read directories (a lower bound
of every key inside: `prefix + segment + "/"`, or `prefix + piece` for a continuation directory).
Popping the smallest and reading a directory only when it is popped yields keys in order, reads only
the directories a page needs, and skips whole subtrees that fall before `start_after`, outside
`prefix`, or inside one common prefix (a delimiter listing never reads below it).
"""

from __future__ import annotations

import heapq
import itertools

from threefs.client import DIRECTORY, FILE
from threefs.common.status import ThreeFSError
from threefs.s3 import keymap
from threefs.s3.errors import S3Error, from_threefs

HEAP_ENTRIES_MAX = 4_000_000  # bounds a listing's memory (a directory of millions of entries)


class Page:
    def __init__(self):
        self.contents: list = []  # ObjectInfo-like tuples (key, size, mtime_s, etag)
        self.prefixes: list[str] = []
        self.truncated = False
        self.last = ""  # the last key or common prefix returned (the continuation point)


def _start(store, bucket: str, prefix: str) -> tuple[str, str]:
    """The deepest directory that holds every key with `prefix`: (its key prefix, its path)."""
    comps: list[str] = []
    segments = prefix.split("/")[:-1]
    for seg in segments:
        comps.extend(keymap.encode_segment(seg))
    path = "/".join([store.bucket_path(bucket)] + comps)
    return "".join(s + "/" for s in segments), path


def _skippable(bound: str, start_after: str) -> bool:
    """Every key beginning with `bound` sorts at or before start_after."""
    return bound <= start_after and not start_after.startswith(bound)


ESCAPED_END = "&"  # every escaped name starts with "%": all of them sort below "&"


async def _read_range(store, path: str, cred, after: str, stop) -> list:
    """Directory entries after `after` (exclusive), page by page, until stop(name) is true."""
    entries = []
    while True:
        try:
            rsp = await store.aio.readdir(path, after, user=cred)
        except (FileNotFoundError, NotADirectoryError):
            return entries
        except ThreeFSError as e:
            raise from_threefs(e, path) from None
        for e in rsp.entries:
            if stop(e.name):
                return entries
            entries.append(e)
        if not rsp.more or not rsp.entries:
            return entries
        after = rsp.entries[-1].name


def _plain_segment(text: str, bound: str) -> str:
    """The segment of `text` right below the directory `bound`, if it is stored as a plain name."""
    if not text.startswith(bound) or len(text) == len(bound):
        return ""
    seg = text[len(bound):].split("/", 1)[0]
    return seg if seg and keymap.encode_segment(seg) == [seg] else ""


def _just_below(name: str) -> str:
    c = ord(name[-1]) - 1
    if 0xD800 <= c <= 0xDFFF:
        c = 0xD7FF
    return name[:-1] + chr(c) + "\U0010ffff" * 4


async def _read_dir(store, path: str, cred, bound: str, prefix: str, start_after: str) -> list:
    """The entries of a directory that can hold wanted keys. Plain names sort as their keys do, so
    the plain ones below the prefix's or start-after's segment are skipped (read from just below it,
    and up to the last name the prefix allows); the escaped names (all below ESCAPED_END) are always
    read, since their keys sort elsewhere."""
    low = max(_plain_segment(start_after, bound), _plain_segment(prefix, bound))
    want = _plain_segment(prefix, bound)
    def high(name: str) -> bool:  # past every plain name the prefix allows (escaped ones come before)
        return bool(want) and name >= ESCAPED_END and name > want and not name.startswith(want)

    if not low or low <= ESCAPED_END:
        return await _read_range(store, path, cred, "", high)
    escaped = await _read_range(store, path, cred, "", lambda n: n >= ESCAPED_END)
    rest = await _read_range(store, path, cred, _just_below(low), high)
    seen = {e.name for e in escaped}
    return escaped + [e for e in rest if e.name not in seen]


async def list_page(store, bucket: str, cred, prefix: str, delimiter: str, start_after: str,
                    max_keys: int) -> Page:
    page = Page()
    if max_keys <= 0:
        return page
    base, path = _start(store, bucket, prefix)
    seq = itertools.count()
    heap = [(base, 1, next(seq), path, 0)]  # (bound or key, 0 file / 1 dir, tiebreak, path, inode)
    files: list = []  # (key, inode, path) in order, until max_keys + 1 items are known
    items = 0
    last_cp = None
    last_key = None
    while heap and items <= max_keys:
        bound, is_dir, _, path, inode = heapq.heappop(heap)
        if is_dir:
            if not (bound.startswith(prefix) or prefix.startswith(bound)) or _skippable(bound, start_after):
                continue
            if delimiter and bound.startswith(prefix):
                i = bound.find(delimiter, len(prefix))
                if i >= 0:
                    cp = bound[:i + len(delimiter)]
                    if cp != last_cp and not _cp_skipped(cp, start_after):
                        last_cp = cp
                        items += 1
                        files.append((cp, None, None))
                    continue
            entries = await _read_dir(store, path, cred, bound, prefix, start_after)
            if len(heap) + len(entries) > HEAP_ENTRIES_MAX:
                raise S3Error("InternalError", f"listing needs more than {HEAP_ENTRIES_MAX} entries in memory",
                              500)
            for e in entries:
                if e.type not in (FILE, DIRECTORY):
                    continue
                text, exact = keymap.entry_key(bound, e.name, e.type == DIRECTORY)
                heapq.heappush(heap, (text, 0 if exact else 1, next(seq), f"{path}/{e.name}", e.inode))
            continue
        key = bound
        if key == last_key or key <= start_after or not key.startswith(prefix):
            continue
        last_key = key
        if delimiter:
            i = key.find(delimiter, len(prefix))
            if i >= 0:
                cp = key[:i + len(delimiter)]
                if cp != last_cp and not _cp_skipped(cp, start_after):
                    last_cp = cp
                    items += 1
                    files.append((cp, None, None))
                continue
        items += 1
        files.append((key, inode, path))
    if items > max_keys:
        page.truncated = True
        files = files[:max_keys]
    await _fill(store, page, files)
    return page


def _cp_skipped(cp: str, start_after: str) -> bool:
    return cp == start_after or _skippable(cp, start_after)


async def _fill(store, page: Page, files: list) -> None:
    objects = [(k, i, p) for k, i, p in files if i is not None]
    attrs = await store.aio.batch_stat([p for _, _, p in objects], follow=False) if objects else []
    records = [None if isinstance(a, Exception) else store._cached(a) for a in attrs]
    missing = [i for i, (a, r) in enumerate(zip(attrs, records)) if r is None and not isinstance(a, Exception)]
    for i, r in zip(missing, await store.read_records([attrs[i].inode for i in missing])):
        records[i] = r
        if r is not None:
            store._remember(attrs[i], r)
    by_key = {}
    for (key, _, _), attr, record in zip(objects, attrs, records):
        if isinstance(attr, Exception):
            continue  # deleted since the directory was read
        from threefs.s3.store import _pseudo_etag

        etag = (record or {}).get("etag") or _pseudo_etag(attr)
        by_key[key] = (key, attr.length, attr.mtime_ns / 1e9, etag)
    for key, inode, _ in files:
        if inode is None:
            page.prefixes.append(key)
            page.last = key
        elif key in by_key:
            page.contents.append(by_key[key])
            page.last = key
