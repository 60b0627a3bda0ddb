"""Buckets and objects on threefs: atomic PUTs, streaming GETs, listings, metadata records.

Layout under the gateway's root directory R (default `/`):

    R/BUCKET/...            objects as files (key -> path: threefs/s3/keymap.py)
    R/.s3/tmp/              new objects are written here, then renamed into place (1733: sticky,
                            nobody lists others' names)
    R/.s3/meta/INODE        one metadata record per object file, named by its inode (JSON: ETag,
                            content type, user metadata, ...); a rename moves the inode, so data and
                            record are replaced together, atomically
    R/.s3/uploads/BUCKET/ID multipart uploads: `info` plus one file per part
    R/.s3/keys/ACCESS_KEY   access keys (threefs/s3/keys.py)

Every namespace call acts for the request's threefs user (uid/gid): threefs's permissions apply.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import time
import uuid

from threefs.client import DIRECTORY, FILE, NO_PARENT, UTIME_NOW, UserCred
from threefs.common.status import StatusCode, ThreeFSError
from threefs.s3 import keymap
from threefs.s3.errors import S3Error, from_threefs

PIECE_BYTES = 8 << 20  # one storage batch of a streamed GET/PUT/copy
PIECES_IN_FLIGHT = 3
RECORD_CACHE_ENTRIES_MAX = 100_000
BUCKET_SEEN_S = 2.0
BUCKET_MODE = 0o700  # private to its owner, as S3's default; chmod it (FUSE, CLI) or set an ACL to share
OBJECT_DEFAULT_MODE = 0o644  # readable by whoever may search its bucket (a private bucket hides it)
TEMP_AGE_S_MAX = 24 * 3600.0  # a temp file untouched this long belongs to a PUT that died
RETRIES_MAX = 8  # namespace races with other gateways (a parent removed under us, ...)


def _code(e: ThreeFSError) -> StatusCode:
    return e.code


class ObjectInfo:
    __slots__ = ("key", "attr", "record", "path")

    def __init__(self, key: str, attr, record: dict, path: str):
        self.key, self.attr, self.record, self.path = key, attr, record, path

    @property
    def etag(self) -> str:
        return self.record.get("etag") or _pseudo_etag(self.attr)

    @property
    def size(self) -> int:
        return self.attr.length

    @property
    def mtime(self) -> float:
        return self.attr.mtime_ns / 1e9


def _pseudo_etag(attr) -> str:
    """A file written outside the gateway has no record: an ETag that changes when it changes."""
    return hashlib.md5(f"{attr.inode}:{attr.length}:{attr.mtime_ns}".encode()).hexdigest()


def may(attr, cred: UserCred | None, want: int) -> bool:
    """POSIX permission bits (want: 4 read, 2 write, 1 search) for cred; root may do anything."""
    if cred is None or cred.uid == 0:
        return True
    if attr.uid == cred.uid:
        bits = attr.mode >> 6
    elif attr.gid == cred.gid or attr.gid in cred.gids:
        bits = attr.mode >> 3
    else:
        bits = attr.mode
    return bits & want == want


BUCKET_CONFIGS = ("tagging", "cors", "acl", "lifecycle")


class Store:
    def __init__(self, aio, root: str = "/"):
        self.aio = aio
        self.root = "/" + root.strip("/")
        base = self.root.rstrip("/")
        self.sys = f"{base}/.s3"
        self.tmp, self.meta, self.uploads = f"{self.sys}/tmp", f"{self.sys}/meta", f"{self.sys}/uploads"
        # records by (inode, mtime): a record changes only with its inode, or by a metadata-only copy,
        # which also moves the object's mtime (so no gateway serves a stale record from its cache)
        self._records: collections.OrderedDict = collections.OrderedDict()
        self._bucket_configs: collections.OrderedDict = collections.OrderedDict()
        self._buckets_seen: dict[tuple[str, int], float] = {}

    async def setup(self) -> None:
        """Create the gateway's own directories (idempotent; any gateway may do it)."""
        if self.root != "/":
            await self._mkdir_p(self.root, None)
        # tmp: anyone may create (sticky: only their own files), nobody else may list the names
        for path, mode in ((self.sys, 0o755), (self.tmp, 0o1733), (self.meta, 0o700),
                           (self.uploads, 0o700), (f"{self.sys}/keys", 0o700)):
            try:
                await self.aio.mkdir_at(NO_PARENT, path, mode)
            except FileExistsError:
                pass
            if mode & 0o1000:  # the umask-free mode, also on a directory an older gateway made
                await self.aio.setattr(path, mode=mode)

    # -- paths ------------------------------------------------------------------------------------
    def bucket_path(self, bucket: str) -> str:
        if bucket.startswith(".") or "/" in bucket or not bucket:  # never the gateway's own .s3, never ..
            raise S3Error("InvalidBucketName", f"bucket name {bucket!r} is not valid")
        return f"{self.root.rstrip('/')}/{bucket}"

    def object_paths(self, bucket: str, key: str) -> tuple[str, str, str]:
        """(parent directory, plain path, alternative path) of a key."""
        comps, name = keymap.key_components(key)
        parent = "/".join([self.bucket_path(bucket)] + comps)
        return parent, f"{parent}/{name}", f"{parent}/{keymap.ALT_PREFIX}{name}"

    # -- buckets ----------------------------------------------------------------------------------
    async def bucket_attr(self, bucket: str, cred) :
        try:
            attr = await self.aio.lstat(self.bucket_path(bucket), cred)
        except FileNotFoundError:
            raise S3Error("NoSuchBucket", "the specified bucket does not exist", BucketName=bucket) from None
        except ThreeFSError as e:
            raise from_threefs(e, bucket) from None
        if attr.type != DIRECTORY:
            raise S3Error("NoSuchBucket", "the specified bucket does not exist", BucketName=bucket)
        return attr

    async def check_bucket(self, bucket: str, cred) -> None:
        """NoSuchBucket before a PUT reads its body (an Expect: 100-continue client then sends none);
        a bucket seen in the last BUCKET_SEEN_S is not looked up again (a bucket deleted meanwhile
        still fails the PUT, at its rename)."""
        seen = (bucket, cred.uid if cred else 0)
        if time.monotonic() - self._buckets_seen.get(seen, -BUCKET_SEEN_S) < BUCKET_SEEN_S:
            return
        await self.bucket_attr(bucket, cred)
        if len(self._buckets_seen) > 10_000:
            self._buckets_seen.clear()
        self._buckets_seen[seen] = time.monotonic()

    async def create_bucket(self, bucket: str, cred) -> None:
        keymap.check_bucket_name(bucket)
        try:  # any key may create buckets (as in S3): made by the gateway, then given to the user
            await self.aio.mkdir_at(NO_PARENT, self.bucket_path(bucket), BUCKET_MODE)
            if cred is not None:
                await self.aio.setattr(self.bucket_path(bucket), uid=cred.uid, gid=cred.gid)
        except FileExistsError:
            attr = await self.aio.lstat(self.bucket_path(bucket))
            if attr.type == DIRECTORY and (cred is None or attr.uid == cred.uid):
                raise S3Error("BucketAlreadyOwnedByYou", "you already own this bucket", BucketName=bucket)
            raise S3Error("BucketAlreadyExists", "the bucket name is taken", BucketName=bucket) from None
        except ThreeFSError as e:
            raise from_threefs(e, bucket) from None

    async def delete_bucket(self, bucket: str, cred) -> None:
        attr = await self.bucket_attr(bucket, cred)
        if cred is not None and attr.uid != cred.uid:
            raise S3Error("AccessDenied", f"bucket {bucket} belongs to uid {attr.uid}, not to this key's user")
        path = self.bucket_path(bucket)
        try:  # the owner may delete its bucket although the root directory is not writable to it
            await self.aio.rmdir_at(NO_PARENT, path)
        except ThreeFSError as e:
            if e.code != StatusCode.NOT_EMPTY:
                raise from_threefs(e, bucket) from None
            # only empty directories left (S3 has no directories): the bucket is empty to S3
            page = await self.list(bucket, cred, max_keys=1)
            if page.contents or page.prefixes:
                raise S3Error("BucketNotEmpty", "the bucket you tried to delete is not empty",
                              BucketName=bucket)
            await self.aio.remove(path, recursive=True)
        for kind in BUCKET_CONFIGS:  # a bucket made again under this name is a new inode: nothing leaks
            await self.drop_record(attr.inode, kind)

    # -- bucket configurations (tags, CORS): one record each, named by the bucket directory's inode ----
    async def bucket_config(self, bucket: str, kind: str, cred):
        """(bucket attr, the configuration of `kind` or None). Cached by the directory's (inode, mtime,
        ctime): a change through any gateway moves its ctime (see set_bucket_config)."""
        attr = await self.bucket_attr(bucket, cred)
        key = (kind, attr.inode, attr.mtime_ns, attr.ctime_ns)
        if key in self._bucket_configs:
            return attr, self._bucket_configs[key]
        (record,) = await self.read_records([attr.inode], kind)
        value = None if record is None else record.get("value")
        self._bucket_configs[key] = value
        if len(self._bucket_configs) > RECORD_CACHE_ENTRIES_MAX:
            self._bucket_configs.popitem(last=False)
        return attr, value

    async def set_bucket_config(self, bucket: str, kind: str, value, cred, mode: int | None = None) -> None:
        """Replace (value None: delete) a bucket configuration, and set the directory's mode if given;
        only the bucket's owner (or root) may."""
        assert kind in BUCKET_CONFIGS, kind
        attr = await self.bucket_attr(bucket, cred)
        if cred is not None and cred.uid != 0 and attr.uid != cred.uid:
            raise S3Error("AccessDenied", f"only the owner of bucket {bucket} (uid {attr.uid}) may change "
                          f"its {kind} configuration")
        if value is None:
            await self.drop_record(attr.inode, kind)
        else:
            await self.write_record(attr.inode, {"value": value}, replace=True, kind=kind)
        try:  # moves its ctime: every gateway looks again
            await self.aio.setattr(self.bucket_path(bucket), mode=mode)
        except ThreeFSError as e:
            raise from_threefs(e, bucket) from None

    async def chmod_object(self, info, mode: int, cred) -> None:
        """An object's mode from its ACL; threefs lets only the file's owner (or root) change it."""
        try:
            await self.aio.setattr(info.path, mode=mode, user=cred)
        except ThreeFSError as e:
            raise from_threefs(e, info.key) from None

    async def list_buckets(self, cred) -> list:
        out = []
        after = ""
        while True:
            rsp = await self.aio.readdir(self.root, after, user=cred)
            names = [e.name for e in rsp.entries if e.type == DIRECTORY]
            for e in rsp.entries:
                after = e.name
            attrs = await self.aio.batch_stat([f"{self.root.rstrip('/')}/{n}" for n in names]) if names else []
            for name, attr in zip(names, attrs):
                if isinstance(attr, Exception) or not keymap.BUCKET_RE.match(name):
                    continue
                if cred is None or cred.uid == 0 or attr.uid == cred.uid:
                    out.append((name, attr.ctime_ns / 1e9))
            if not rsp.more or not rsp.entries:
                return out

    # -- metadata records ---------------------------------------------------------------------------
    def record_path(self, inode: int, kind: str = "") -> str:
        return f"{self.meta}/{inode:x}" + (f".{kind}" if kind else "")

    async def create_record(self, inode: int, replace: bool = False, kind: str = ""):
        path = self.record_path(inode, kind)
        target = f"{path}.{uuid.uuid4().hex[:8]}" if replace else path
        return target, await self.aio.create_at(NO_PARENT, target, os.O_WRONLY | os.O_TRUNC, 0o600)

    async def fill_record(self, opened, record: dict) -> None:
        target, rsp = opened
        data = json.dumps(record, separators=(",", ":")).encode()
        await self.aio.write_at(rsp.attr, 0, data)
        await self.aio.close_file(rsp.attr.inode, rsp.session, len(data), exact=False)  # written whole, here

    async def write_record(self, inode: int, record: dict, replace: bool = False, kind: str = "") -> None:
        opened = await self.create_record(inode, replace, kind)
        await self.fill_record(opened, record)
        if replace:
            await self.aio.rename(opened[0], self.record_path(inode, kind))

    async def replace_metadata(self, info, record: dict) -> float:
        """A metadata-only update (copy onto itself): the record, then the object's mtime."""
        await self.write_record(info.attr.inode, record, replace=True)
        attr = await self.aio.setattr(info.path, mtime_ns=UTIME_NOW)
        return attr.mtime_ns / 1e9

    async def replace_record(self, info, record: dict) -> None:
        """A record change that keeps the object's Last-Modified (tags): the record, then the object's
        ctime (an empty setattr), which every gateway's record cache is keyed by."""
        await self.write_record(info.attr.inode, record, replace=True)
        await self.aio.setattr(info.path)

    def _cached(self, attr) -> dict | None:
        # keyed by mtime and ctime: a record replaced by another gateway moves one of them (see
        # replace_metadata and replace_record), so no gateway serves the old record after that
        key = (attr.inode, attr.mtime_ns, attr.ctime_ns)
        hit = self._records.get(key)
        if hit is not None:
            self._records.move_to_end(key)
        return hit

    def _remember(self, attr, record: dict) -> None:
        self._records[(attr.inode, attr.mtime_ns, attr.ctime_ns)] = record
        if len(self._records) > RECORD_CACHE_ENTRIES_MAX:
            self._records.popitem(last=False)

    async def read_records(self, inodes: list[int], kind: str = "") -> list[dict | None]:
        """Records of many inodes: one batch stat and one batch read."""
        if not inodes:
            return []
        attrs = await self.aio.batch_stat([self.record_path(i, kind) for i in inodes])
        reqs, where = [], []
        for i, a in enumerate(attrs):
            if not isinstance(a, Exception) and a.length <= 1 << 20:
                reqs.append((a, 0, memoryview(bytearray(a.length))))
                where.append(i)
        out: list[dict | None] = [None] * len(inodes)
        if reqs:
            results = await self.aio.batch_read(reqs)
            for i, (a, _, buf), r in zip(where, reqs, results):
                if not isinstance(r, Exception):
                    try:
                        out[i] = json.loads(bytes(buf[:r]))
                    except ValueError:
                        pass
        return out

    async def drop_record(self, inode: int, kind: str = "") -> None:
        try:
            await self.aio.remove(self.record_path(inode, kind))
        except (FileNotFoundError, ThreeFSError):
            pass

    # -- objects ----------------------------------------------------------------------------------
    async def head(self, bucket: str, key: str, cred) -> ObjectInfo:
        """The object's attributes and record, or NoSuchKey / NoSuchBucket."""
        for _ in range(3):
            _, plain, alt = self.object_paths(bucket, key)
            found = None
            try:
                attrs = await self.aio.batch_stat([plain, alt], follow=True, user=cred)
            except ThreeFSError as e:
                raise from_threefs(e, key) from None
            for path, a in zip((plain, alt), attrs):
                if not isinstance(a, Exception) and a.type == FILE:
                    found = (path, a)
                    break
                if isinstance(a, ThreeFSError) and a.code == StatusCode.PERMISSION_DENIED:
                    raise S3Error("AccessDenied", f"threefs denies access to {key}")
            if found is None:
                await self.bucket_attr(bucket, cred)
                raise S3Error("NoSuchKey", "the specified key does not exist", Key=key)
            path, attr = found
            record = self._cached(attr)
            if record is None:
                (record,) = await self.read_records([attr.inode])
                if record is None and await self._replaced(path, attr):
                    continue  # replaced between the stat and the record read: look again
                if record is not None:
                    self._remember(attr, record)
            return ObjectInfo(key, attr, record or {}, path)
        raise S3Error("ServiceUnavailable", f"{key} keeps changing; try again", 503)

    async def readable(self, bucket: str, key: str, cred) -> ObjectInfo:
        """head(), and the user may read the file (GET, and the source of a copy)."""
        info = await self.head(bucket, key, cred)
        if not may(info.attr, cred, 4):
            raise S3Error("AccessDenied", f"threefs denies reading {key} (mode {info.attr.mode:o}, owner "
                          f"{info.attr.uid}:{info.attr.gid})")
        return info

    async def _replaced(self, path: str, attr) -> bool:
        try:
            return (await self.aio.stat(path)).inode != attr.inode
        except FileNotFoundError:
            return True

    async def read_stream(self, info: ObjectInfo, start: int, end: int):
        """Yield the bytes [start, end) of an object in PIECE_BYTES pieces, two reads in flight."""
        attr = info.attr

        async def read(offset: int, n: int) -> bytearray:
            buf = bytearray(n)
            got = await self.aio.read_into(attr, offset, buf)
            if got != n:
                raise S3Error("InternalError", f"{info.key} is shorter than its length", 500)
            return buf

        pending: list[asyncio.Task] = []
        offset = start
        try:
            while offset < end or pending:
                while offset < end and len(pending) < PIECES_IN_FLIGHT:
                    n = min(PIECE_BYTES, end - offset)
                    pending.append(asyncio.ensure_future(read(offset, n)))
                    offset += n
                yield await pending.pop(0)
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def new_temp(self, cred, record: dict | None = None):
        """A fresh file in R/.s3/tmp owned by the user: (path, OpenRsp). Its mode is the one of the
        canned ACL in `record` (see acl.py), 0644 without one."""
        from threefs.s3.acl import OBJECT_MODES

        mode = OBJECT_MODES.get((record or {}).get("acl"), OBJECT_DEFAULT_MODE)
        path = f"{self.tmp}/{uuid.uuid4().hex}"
        try:
            rsp = await self.aio.create_at(NO_PARENT, path, os.O_WRONLY | os.O_EXCL, mode, cred)
        except ThreeFSError as e:
            raise from_threefs(e, "a new object") from None
        return path, rsp

    async def write_stream(self, rsp, body, hashers: list, base: int = 0) -> int:
        """Write an async iterable of byte pieces into an open file, PIECE_BYTES per storage batch
        with writes in flight while more arrives; feeds each hasher. Returns the length."""
        attr = rsp.attr
        buf = bytearray()
        offset = base
        pending: list[asyncio.Task] = []

        async def flush(data: bytearray, at: int) -> None:
            await self.aio.write_at(attr, at, data)

        try:
            async for piece in body:
                for h in hashers:
                    h.update(piece)
                buf += piece
                if len(buf) >= PIECE_BYTES:
                    while len(pending) >= PIECES_IN_FLIGHT:
                        await pending.pop(0)
                    pending.append(asyncio.ensure_future(flush(buf, offset)))
                    offset += len(buf)
                    buf = bytearray()
            if buf:
                pending.append(asyncio.ensure_future(flush(buf, offset)))
                offset += len(buf)
            while pending:
                await pending.pop(0)
        finally:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return offset - base

    async def sweep_temp(self, age_s_min: float = TEMP_AGE_S_MAX) -> int:
        """Delete temp files (and their records) older than age_s_min: PUTs that died half-way."""
        entries = await self.aio.listdir(self.tmp)
        removed = 0
        now_ns = time.time_ns()
        for i in range(0, len(entries), 1000):
            page = entries[i:i + 1000]
            attrs = await self.aio.batch_stat([f"{self.tmp}/{e.name}" for e in page], follow=False)
            for e, a in zip(page, attrs):
                if not isinstance(a, Exception) and now_ns - a.mtime_ns > age_s_min * 1e9:
                    await self.discard(f"{self.tmp}/{e.name}")
                    await self.drop_record(a.inode)
                    removed += 1
        return removed

    async def discard(self, path: str) -> None:
        try:
            await self.aio.remove(path)
        except ThreeFSError:
            pass

    async def publish(self, temp_path: str, rsp, length: int, record: dict, bucket: str, key: str, cred,
                      if_none_match: bool = False, record_file=None) -> object:
        """Close the temp file, write its record (`record_file`: already created by create_record),
        rename it over the key's path (atomic replace); remove the record of the object it replaced.
        Returns the new attr."""
        opened = await record_file if record_file is not None else None

        async def record_written():
            await self.fill_record(opened or await self.create_record(rsp.attr.inode), record)

        _, plain, alt = self.object_paths(bucket, key)
        attr, _, first_look = await asyncio.gather(  # one round trip for three calls
            self.aio.close_file(rsp.attr.inode, rsp.session, length, exact=False), record_written(),
            self.aio.batch_stat([plain, alt], follow=False))
        try:
            old = await self._rename_into_place(temp_path, bucket, key, cred, if_none_match, first_look)
        except BaseException:
            await self.discard(temp_path)
            await self.drop_record(attr.inode)
            raise
        if old is not None and old != attr.inode:
            await self.drop_record(old)
        return attr

    async def _rename_into_place(self, temp: str, bucket: str, key: str, cred, noreplace: bool,
                                 first_look: list | None = None) -> int | None:
        """Rename temp onto the key's plain name, or its %o name while the plain one is a directory;
        returns the inode it replaced. `first_look`: a batch stat of (plain, alt) already made."""
        parent, plain, alt = self.object_paths(bucket, key)
        for _ in range(RETRIES_MAX):
            attrs, first_look = first_look or await self.aio.batch_stat([plain, alt], follow=False), None
            old_plain, old_alt = (None if isinstance(a, Exception) else a for a in attrs)
            target = alt if old_plain is not None and old_plain.type == DIRECTORY else plain
            old = old_alt if target == alt else old_plain
            if noreplace and (old is not None or (old_alt is not None and old_alt.type == FILE)):
                raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified "
                              "did not hold", Condition="If-None-Match")
            try:
                await self.aio.rename_at(NO_PARENT, temp, NO_PARENT, target, noreplace, cred)
            except FileNotFoundError:
                await self.bucket_attr(bucket, cred)
                await self._make_parents(bucket, key, cred)
                continue
            except ThreeFSError as e:
                if e.code in (StatusCode.IS_DIRECTORY, StatusCode.EXISTS, StatusCode.NOT_EMPTY):
                    if noreplace and e.code == StatusCode.EXISTS:
                        raise S3Error("PreconditionFailed", "At least one of the pre-conditions you "
                                      "specified did not hold", Condition="If-None-Match") from None
                    continue  # a directory appeared at the plain name: look again
                if e.code == StatusCode.NOT_DIRECTORY:
                    await self._make_parents(bucket, key, cred)
                    continue
                raise from_threefs(e, key) from None
            if target == plain and old_alt is not None and old_alt.type == FILE:
                await self._unlink_quiet(alt, cred)  # an older copy from when `plain` was a directory
                await self.drop_record(old_alt.inode)
            return old.inode if old is not None and old.type == FILE else None
        raise S3Error("ServiceUnavailable", f"{key}: the namespace kept changing under the upload", 503)

    async def _unlink_quiet(self, path: str, cred) -> None:
        try:
            await self.aio.unlink_at(NO_PARENT, path, cred)
        except ThreeFSError:
            pass

    async def _make_parents(self, bucket: str, key: str, cred) -> None:
        """Create the key's directories; a file in the way (object `a` when writing `a/b`) moves to
        its alternative name `%oa` beside the directory."""
        comps, _ = keymap.key_components(key)
        path = self.bucket_path(bucket)
        for comp in comps:
            parent, path = path, f"{path}/{comp}"
            for _ in range(RETRIES_MAX):
                try:
                    await self.aio.mkdir_at(NO_PARENT, path, 0o755, cred)
                    break
                except FileExistsError:
                    attr = await self._lstat_or_none(path)
                    if attr is None:
                        continue
                    if attr.type == DIRECTORY:
                        break
                    try:  # the object `comp` itself: make room for the directory
                        await self.aio.rename_at(NO_PARENT, path, NO_PARENT,
                                                 f"{parent}/{keymap.ALT_PREFIX}{comp}", False, cred)
                    except FileNotFoundError:
                        pass
                except ThreeFSError as e:
                    raise from_threefs(e, key) from None

    async def _lstat_or_none(self, path: str):
        try:
            return await self.aio.lstat(path)
        except FileNotFoundError:
            return None

    async def delete(self, bucket: str, key: str, cred) -> None:
        """Delete an object (no error if absent), then its empty parent directories."""
        await self.bucket_attr(bucket, cred)
        parent, plain, alt = self.object_paths(bucket, key)
        attrs = await self.aio.batch_stat([plain, alt], follow=False, user=cred)
        for path, a in zip((plain, alt), attrs):
            if isinstance(a, Exception) or a.type == DIRECTORY:
                if isinstance(a, ThreeFSError) and a.code == StatusCode.PERMISSION_DENIED:
                    raise S3Error("AccessDenied", f"threefs denies access to {key}")
                continue
            try:
                await self.aio.unlink_at(NO_PARENT, path, cred)
            except FileNotFoundError:
                continue
            except ThreeFSError as e:
                raise from_threefs(e, key) from None
            if a.nlink <= 1:
                await self.drop_record(a.inode)
        await self._prune(bucket, parent, cred)

    async def _prune(self, bucket: str, parent: str, cred) -> None:
        top = self.bucket_path(bucket)
        while parent != top and parent.startswith(top + "/"):
            try:
                await self.aio.rmdir_at(NO_PARENT, parent, cred)
            except ThreeFSError:
                return  # not empty (or someone writes into it right now): stop
            parent = parent.rsplit("/", 1)[0]

    # -- listing ----------------------------------------------------------------------------------
    async def list(self, bucket: str, cred, prefix: str = "", delimiter: str = "", start_after: str = "",
                   max_keys: int = 1000):
        from threefs.s3.listing import list_page

        await self.bucket_attr(bucket, cred)
        return await list_page(self, bucket, cred, prefix, delimiter, start_after, max_keys)

    async def copy_data(self, src, start: int, end: int, rsp, hashers: list, base: int = 0) -> int:
        return await self.write_stream(rsp, self.read_stream(src, start, end), hashers, base)


def now_s() -> float:
    return time.time()
