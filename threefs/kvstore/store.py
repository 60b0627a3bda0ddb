"""KVStore: get / put / delete / batches / prefix scans / compare-and-set, values from bytes to gigabytes.

    kv = KVStore.create(fs, "/kv/users")              # a store is a directory
    kv.put(b"user:7", b'{"name": "x"}')               # -> the key's new version
    kv.get(b"user:7")                                 # -> bytes, or None
    kv.compare_and_set(b"user:7", b'{"name": "x"}', b'{"name": "y"}')   # -> True / False
    with kv.batch() as b:                             # atomic: all or nothing
        b.put(b"a", b"1"); b.delete(b"b"); b.check_version(b"c", 3)
    for key, value in kv.scan(b"user:"): ...
    kv.put(b"model", open("weights.bin", "rb"))       # a file object: streamed into a blob file

Values up to 64 KiB live inline in meta's KV record (one meta RPC per operation, a KV transaction); larger
ones in a file of the store's `.blobs/` directory (replicated chunks, read and written straight to
storage), named by the record. A put of a large value writes the blob first, then swaps the record in
one transaction, then removes the blob the record named before; a get reads the record, the blob, and
checks the record again (a concurrent overwrite could have removed the blob it read). Every operation
is strongly consistent (linearizable): each is one serializable transaction on meta's KV.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Iterator
from typing import NamedTuple

from threefs.client import kvstore_client as kc
from threefs.common.status import StatusCode, ThreeFSError, status_error

log = logging.getLogger(__name__)

BLOBS_DIR = ".blobs"
STREAM_PIECE_BYTES = 8 << 20
GET_RETRIES_MAX = 8  # a large value overwritten while being read is read again
BLOB_GC_AGE_S = 3600.0


class Item(NamedTuple):
    key: bytes
    value: bytes
    version: int
    length: int
    mtime_ns: int


def _key(key) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    elif isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"a key is bytes or str, not {type(key).__name__}")
    if not 0 < len(key) <= kc.KEY_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"a key is 1 to {kc.KEY_BYTES_MAX} bytes, not {len(key)}")
    return key


def digest_of(value) -> bytes:
    return hashlib.blake2b(value, digest_size=16).digest()


class KVStore:
    """A key-value store in the directory `path` (see the module docstring). Thread-safe."""

    def __init__(self, fs, path: str, *, inline_bytes_max: int = kc.INLINE_BYTES_MAX):
        if not isinstance(path, str) or not path.startswith("/"):
            raise status_error(StatusCode.INVALID_PATH, f"store path {path!r} must be absolute")
        if not 0 <= inline_bytes_max <= kc.INLINE_BYTES_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"inline_bytes_max is 0..{kc.INLINE_BYTES_MAX}")
        self.fs, self.path = fs, path.rstrip("/") or "/"
        self.blobs = f"{self.path.rstrip('/')}/{BLOBS_DIR}"
        self.inline_bytes_max = inline_bytes_max

    @classmethod
    def create(cls, fs, path: str, mode: int = 0o755, **kw) -> "KVStore":
        """Make the store's directory (and parents) if needed."""
        fs.mkdir(path, mode, parents=True, exist_ok=True)
        store = cls(fs, path, **kw)
        fs.mkdir(store.blobs, mode, exist_ok=True)
        return store

    # -- reads -----------------------------------------------------------------------------------------
    def get(self, key, default=None) -> bytes | None:
        item = self.get_item(key)
        return default if item is None else item.value

    def get_item(self, key) -> Item | None:
        return self.get_many_items([key])[0]

    def get_many(self, keys) -> list[bytes | None]:
        return [None if i is None else i.value for i in self.get_many_items(keys)]

    def get_many_items(self, keys) -> list[Item | None]:
        """Items of up to 1000 keys in one snapshot (large values are read from their blobs)."""
        keys = [_key(k) for k in keys]
        if not keys:
            return []
        if len(keys) > kc.OPS_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"get_many takes at most {kc.OPS_MAX} keys")
        records = self._run(kc.kv_get(self.fs.aio, self.path, keys))
        return self._items(keys, records)

    def get_to(self, key, dst) -> int | None:
        """Write the value of `key` into the binary file object `dst` without holding it in memory (for
        values of gigabytes); returns its length, or None if the key is absent. If the value is replaced
        while it is copied, `dst` is rewound and truncated and the copy starts again (a `dst` that cannot
        seek gets BUSY instead)."""
        key = _key(key)
        start = dst.tell() if dst.seekable() else None
        for _ in range(GET_RETRIES_MAX):
            rec = self._run(kc.kv_get(self.fs.aio, self.path, [key]))[0]
            if rec is None:
                return None
            if not rec.blob:
                dst.write(rec.value)
                return rec.length
            try:
                with self.fs.open(f"{self.blobs}/{rec.blob}", "rb") as src:
                    copied = _copy(src, dst)
            except FileNotFoundError:
                copied = -1
            again = self._run(kc.kv_get(self.fs.aio, self.path, [key]))[0]
            if copied == rec.length and again is not None and again.version == rec.version:
                return copied
            if start is None:
                raise status_error(StatusCode.BUSY, f"the value of {key[:80]!r} was replaced while it was "
                                   "copied to a file object that cannot seek; try again")
            dst.seek(start)
            dst.truncate()
        raise status_error(StatusCode.BUSY, f"the value of {key[:80]!r} kept changing while being read")

    def __getitem__(self, key) -> bytes:
        item = self.get_item(key)
        if item is None:
            raise KeyError(key)
        return item.value

    def __contains__(self, key) -> bool:
        return self.get_item(key) is not None

    def scan(self, prefix=b"", *, start_after=None, limit: int | None = None,
             page: int = kc.SCAN_LIMIT_MAX) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of every key starting with `prefix`, in byte order, after `start_after`. Each page
        (up to `page` keys) is one consistent snapshot; the scan as a whole is not."""
        for item in self.scan_items(prefix, start_after=start_after, limit=limit, page=page):
            yield item.key, item.value

    def keys(self, prefix=b"", *, start_after=None, limit: int | None = None) -> Iterator[bytes]:
        for key, _ in self._scan_records(prefix, start_after, limit, kc.SCAN_LIMIT_MAX):
            yield key

    def scan_items(self, prefix=b"", *, start_after=None, limit: int | None = None,
                   page: int = kc.SCAN_LIMIT_MAX) -> Iterator[Item]:
        rows: list[tuple[bytes, kc.KvRecord]] = []
        for row in self._scan_records(prefix, start_after, limit, page):
            rows.append(row)
            if len(rows) == page:
                yield from self._items([r[0] for r in rows], [r[1] for r in rows])
                rows = []
        if rows:
            yield from self._items([r[0] for r in rows], [r[1] for r in rows])

    def _scan_records(self, prefix, start_after, limit, page) -> Iterator[tuple[bytes, kc.KvRecord]]:
        prefix = b"" if prefix in (b"", "") else _key(prefix)
        after = None if start_after is None else _key(start_after)
        if limit is not None and limit < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, "scan limit must be >= 0")
        if not 1 <= page <= kc.SCAN_LIMIT_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"scan page is 1..{kc.SCAN_LIMIT_MAX}")
        left = limit
        while left is None or left > 0:
            n = page if left is None else min(page, left)
            rsp = self._run(kc.kv_scan(self.fs.aio, self.path, prefix, after, n))
            yield from zip(rsp.keys, rsp.records)
            if left is not None:
                left -= len(rsp.keys)
            if not rsp.more or not rsp.keys:
                return
            after = rsp.keys[-1]

    # -- writes ----------------------------------------------------------------------------------------
    def put(self, key, value) -> int:
        """Store `value` (bytes-like, or a binary file object: streamed) at `key`; returns its version."""
        return self._write_one(_key(key), value, kc.ANY_VERSION, None)

    def __setitem__(self, key, value) -> None:
        self.put(key, value)

    def delete(self, key) -> bool:
        """Remove `key`; True if it existed."""
        key = _key(key)
        rsp = self._write([kc.KvOp(kc.DELETE, key)])
        self._drop_blobs(rsp.replaced_blobs)
        return rsp.existed[0]

    def __delitem__(self, key) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def compare_and_set(self, key, expected, new) -> bool:
        """Set `key` to `new` only if its value is `expected` now (None: absent). `new` None deletes.
        Values of any size are compared (by their digests, inside the transaction)."""
        key = _key(key)
        expect = b"" if expected is None else digest_of(_bytes(expected, "expected"))
        if new is None:
            rsp = self._write([kc.KvOp(kc.DELETE, key, expect_digest=expect)])
            if rsp.ok:
                self._drop_blobs(rsp.replaced_blobs)
            return rsp.ok
        return self._write_one(key, new, kc.ANY_VERSION, expect) > 0

    def compare_and_set_version(self, key, version: int, new) -> bool:
        """Set `key` to `new` (None deletes) only if its version is `version` now (0: absent)."""
        if not isinstance(version, int) or version < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"version must be an int >= 0, not {version!r}")
        key = _key(key)
        if new is None:
            rsp = self._write([kc.KvOp(kc.DELETE, key, expect_version=version)])
            if rsp.ok:
                self._drop_blobs(rsp.replaced_blobs)
            return rsp.ok
        return self._write_one(key, new, version, None) > 0

    def put_many(self, items) -> list[int]:
        """Store many (key, value) pairs atomically; returns their versions."""
        b = self.batch()
        for key, value in (items.items() if isinstance(items, dict) else items):
            b.put(key, value)
        if not b.commit():
            raise status_error(StatusCode.INTERNAL, "an unconditional batch failed")
        return b.versions

    def clear(self) -> None:
        """Remove every key (one transaction), then the blob files."""
        self._write([kc.KvOp(kc.CLEAR, b"")])
        for entry in self.fs.scandir(self.blobs):
            self._remove_blob(entry.name)

    def drop(self) -> None:
        """Remove the store: its keys, then its directory. (Removing the directory any other way leaves
        its records in meta's KV, unreachable: use drop.)"""
        self.clear()
        self.fs.remove_tree(self.path)

    def batch(self) -> "WriteBatch":
        return WriteBatch(self)

    def gc_blobs(self, min_age_s: float = BLOB_GC_AGE_S) -> int:
        """Remove blob files no record names, older than min_age_s (left by clients that died between
        writing a blob and its record, or before removing a replaced one). Returns files removed."""
        now_ns = time.time_ns()
        old = [e.name for e in self.fs.scandir(self.blobs)
               if now_ns - self.fs.stat(f"{self.blobs}/{e.name}").ctime_ns >= min_age_s * 1e9]
        # scanned after listing: a blob whose put committed meanwhile is named by now
        named = {rec.blob for _, rec in self._scan_records(b"", None, None, kc.SCAN_LIMIT_MAX) if rec.blob}
        orphans = [name for name in old if name not in named]
        for name in orphans:
            self._remove_blob(name)
        return len(orphans)

    # -- internals -------------------------------------------------------------------------------------
    def _run(self, coro):
        return self.fs.run(coro)

    def _write(self, ops: list) -> object:
        return self._run(kc.kv_write(self.fs.aio, self.path, ops))

    def _write_one(self, key: bytes, value, expect_version: int, expect_digest: bytes | None) -> int:
        op = self._put_op(key, value)
        op.expect_version, op.expect_digest = expect_version, expect_digest
        try:
            rsp = self._write([op])
        except BaseException:
            self._drop_new_blob(op)
            raise
        if not rsp.ok:
            self._drop_new_blob(op)
            return 0
        self._drop_blobs(rsp.replaced_blobs)
        return rsp.versions[0]

    def _put_op(self, key: bytes, value, inline_room: int = kc.BATCH_INLINE_BYTES_MAX):
        """A PUT op; a large value (or a file object, or one past the batch's inline room) is first written
        to a new blob file."""
        if hasattr(value, "read"):
            return self._put_stream(key, value)
        data = _bytes(value, "value")
        if len(data) <= min(self.inline_bytes_max, inline_room):
            return kc.KvOp(kc.PUT, key, bytes(data), length=len(data), digest=digest_of(data))
        name = uuid.uuid4().hex
        with self.fs.open(f"{self.blobs}/{name}", "xb") as f:
            f.write(data)
        return kc.KvOp(kc.PUT, key, blob=name, length=len(data), digest=digest_of(data))

    def _put_stream(self, key: bytes, src) -> object:
        first = src.read(self.inline_bytes_max + 1)
        if not isinstance(first, (bytes, bytearray)):
            raise status_error(StatusCode.INVALID_ARGUMENT, "a file object value must be opened in binary mode")
        if len(first) <= self.inline_bytes_max:
            return self._put_op(key, first)
        name = uuid.uuid4().hex
        h = hashlib.blake2b(digest_size=16)
        total = 0
        with self.fs.open(f"{self.blobs}/{name}", "xb") as f:
            piece = first
            while piece:
                h.update(piece)
                f.write(piece)
                total += len(piece)
                piece = src.read(STREAM_PIECE_BYTES)
        return kc.KvOp(kc.PUT, key, blob=name, length=total, digest=h.digest())

    def _items(self, keys: list[bytes], records: list) -> list[Item | None]:
        out: list[Item | None] = []
        for attempt in range(GET_RETRIES_MAX):
            blob_keys = [k for k, r in zip(keys, records) if r is not None and r.blob]
            blobs = self._read_blobs([r for r in records if r is not None and r.blob])
            if blob_keys:  # a blob is only valid if its record still names it
                again = self._run(kc.kv_get(self.fs.aio, self.path, blob_keys))
                changed = {k for k, r, a in zip(blob_keys, [r for r in records if r is not None and r.blob],
                                                 again) if a is None or a.version != r.version}
                if changed:
                    records = self._run(kc.kv_get(self.fs.aio, self.path, keys))
                    continue
            out = []
            for key, rec in zip(keys, records):
                if rec is None:
                    out.append(None)
                else:
                    value = blobs[rec.blob] if rec.blob else rec.value
                    out.append(Item(key, value, rec.version, rec.length, rec.mtime_ns))
            return out
        raise status_error(StatusCode.BUSY, f"large values in {self.path} kept changing while being read; "
                           "try again")

    def _read_blobs(self, records: list) -> dict[str, bytes]:
        if not records:
            return {}
        bufs = {r.blob: bytearray(r.length) for r in records}
        items = [(f"{self.blobs}/{name}", 0, buf) for name, buf in bufs.items()]
        results = self.fs.batch_read(items, raise_on_error=False)
        out = {}
        for (name, buf), r in zip(bufs.items(), results):
            if isinstance(r, BaseException) or r != len(buf):
                out[name] = b""  # removed meanwhile: the record re-check sees it changed
            else:
                out[name] = bytes(buf)
        return out

    def _drop_new_blob(self, op) -> None:
        if op.blob:
            self._remove_blob(op.blob)

    def _drop_blobs(self, names: list[str]) -> None:
        for name in names:
            if name:
                self._remove_blob(name)

    def _remove_blob(self, name: str) -> None:
        try:
            self.fs.remove(f"{self.blobs}/{name}")
        except FileNotFoundError:
            pass
        except ThreeFSError as e:  # a leftover blob costs space, not correctness: gc_blobs removes it
            log.warning("could not remove blob %s: %s", name, e)


class WriteBatch:
    """Operations applied atomically by commit() (or at the end of a `with` block): all, or none if one
    of the checks fails. commit() returns whether it applied; `versions` then holds the new versions."""

    def __init__(self, store: KVStore):
        self.store = store
        self.ops: list = []
        self.versions: list[int] = []
        self.committed = False

    def put(self, key, value) -> "WriteBatch":
        self.ops.append(("put", _key(key), value))
        return self

    def delete(self, key) -> "WriteBatch":
        self.ops.append(("delete", _key(key), None))
        return self

    def check_version(self, key, version: int) -> "WriteBatch":
        """Condition: `key` has `version` (0: absent)."""
        if not isinstance(version, int) or version < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"version must be an int >= 0, not {version!r}")
        self.ops.append(("check_version", _key(key), version))
        return self

    def check_value(self, key, expected) -> "WriteBatch":
        """Condition: `key`'s value is `expected` (None: absent)."""
        self.ops.append(("check_value", _key(key), None if expected is None else _bytes(expected, "expected")))
        return self

    def commit(self) -> bool:
        if self.committed:
            raise status_error(StatusCode.INVALID_ARGUMENT, "this batch was committed already")
        if not self.ops:
            self.committed = True
            return True
        if len(self.ops) > kc.OPS_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"a batch holds at most {kc.OPS_MAX} operations")
        s = self.store
        ops = []
        key_bytes = sum(len(key) for _, key, _ in self.ops)
        if key_bytes > kc.KEY_BYTES_PER_CALL_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"a batch's keys take {key_bytes} bytes, over "
                               f"{kc.KEY_BYTES_PER_CALL_MAX}: split the batch")
        room = kc.BATCH_INLINE_BYTES_MAX - 64 * len(self.ops) - key_bytes  # keys and framing share the frame
        try:
            for kind, key, arg in self.ops:
                if kind == "put":
                    op = s._put_op(key, arg, max(room, 0))
                    room -= len(op.value)
                    ops.append(op)
                elif kind == "delete":
                    ops.append(kc.KvOp(kc.DELETE, key))
                elif kind == "check_version":
                    ops.append(kc.KvOp(kc.CHECK, key, expect_version=arg))
                else:
                    ops.append(kc.KvOp(kc.CHECK, key, expect_digest=b"" if arg is None else digest_of(arg)))
            rsp = s._write(ops)
        except BaseException:
            for op in ops:
                s._drop_new_blob(op)
            raise
        self.committed = True
        if not rsp.ok:
            for op in ops:
                s._drop_new_blob(op)
            return False
        s._drop_blobs(rsp.replaced_blobs)
        self.versions = [v for op, v in zip(ops, rsp.versions) if op.kind != kc.CHECK]
        return True

    def __enter__(self) -> "WriteBatch":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None and not self.committed:
            if not self.commit():
                raise status_error(StatusCode.BUSY, "a condition of the batch did not hold; nothing was written "
                                   "(call commit() yourself to get False instead)")


def _copy(src, dst) -> int:
    buf = bytearray(STREAM_PIECE_BYTES)
    view = memoryview(buf)
    total = 0
    while n := src.readinto(buf):
        dst.write(view[:n])
        total += n
    return total


def _bytes(value, what: str):
    if isinstance(value, str):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{what} must be bytes, not str (encode it first)")
    try:
        return memoryview(value).cast("B") if not isinstance(value, bytes) else value
    except TypeError:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{what} must be bytes-like, not "
                           f"{type(value).__name__}") from None

