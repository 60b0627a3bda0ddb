"""Multipart uploads: R/.s3/uploads/BUCKET/UPLOAD_ID/{info, p00001, ...}.

A part is written to a temp name in the upload's directory and renamed to `pNNNNN` (a re-sent part
replaces the old one atomically); its ETag (MD5) and size are in the part's metadata record. Complete
checks the list (order, ETags, the 5 MiB minimum), then either renames the single part into place or
copies the parts, streaming, into a temp file that is renamed into place like any PUT.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid

from threefs.client import NO_PARENT
from threefs.common.status import ThreeFSError
from threefs.s3.errors import S3Error, from_threefs

PART_NUMBER_MAX = 10_000
PART_BYTES_MIN = 5 << 20
PART_BYTES_MAX = 5 << 30


class Multipart:
    def __init__(self, store):
        self.store = store
        self.aio = store.aio

    def _dir(self, bucket: str, upload_id: str = "") -> str:
        d = f"{self.store.uploads}/{bucket}"
        return f"{d}/{upload_id}" if upload_id else d

    async def create(self, bucket: str, key: str, cred, user: str, record: dict) -> str:
        self.store.object_paths(bucket, key)  # validates the key
        upload_id = uuid.uuid4().hex + uuid.uuid4().hex[:8]
        try:
            await self.aio.mkdir(self._dir(bucket, upload_id), 0o700, parents=True)
        except ThreeFSError as e:
            raise from_threefs(e, key) from None
        info = {"key": key, "record": record, "uid": cred.uid if cred else 0, "gid": cred.gid if cred else 0,
                "user": user, "initiated": time.time()}
        await self._write_small(f"{self._dir(bucket, upload_id)}/info", json.dumps(info).encode())
        return upload_id

    async def _write_small(self, path: str, data: bytes) -> None:
        rsp = await self.aio.create_at(NO_PARENT, path, os.O_WRONLY | os.O_TRUNC, 0o600)
        await self.aio.write_at(rsp.attr, 0, data)
        await self.aio.close_file(rsp.attr.inode, rsp.session, len(data), exact=False)

    async def info(self, bucket: str, key: str, upload_id: str) -> dict:
        if not upload_id.isalnum() or len(upload_id) > 128:
            raise S3Error("NoSuchUpload", "the specified upload does not exist", UploadId=upload_id)
        path = f"{self._dir(bucket, upload_id)}/info"
        try:
            attr = await self.aio.stat(path)
            buf = bytearray(attr.length)
            await self.aio.read_into(attr, 0, buf)
            info = json.loads(bytes(buf))
        except (FileNotFoundError, ValueError):
            raise S3Error("NoSuchUpload", "the specified upload does not exist; it may have been "
                          "aborted or completed", UploadId=upload_id) from None
        if key and info["key"] != key:
            raise S3Error("NoSuchUpload", "the upload belongs to another key", UploadId=upload_id)
        return info

    @staticmethod
    def part_number(text: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= PART_NUMBER_MAX:
            raise S3Error("InvalidArgument", f"part number must be an integer between 1 and {PART_NUMBER_MAX}",
                          ArgumentName="partNumber", ArgumentValue=text)
        return int(text)

    async def upload_part(self, bucket: str, key: str, upload_id: str, number: int, fill) -> str:
        """fill(rsp, hashers) writes the part's bytes into an open file and returns its length."""
        await self.info(bucket, key, upload_id)
        d = self._dir(bucket, upload_id)
        temp = f"{d}/t{uuid.uuid4().hex}"
        rsp = await self.aio.create_at(NO_PARENT, temp, os.O_WRONLY | os.O_EXCL, 0o600)
        md5 = hashlib.md5()
        try:
            n = await fill(rsp, [md5])
            if n > PART_BYTES_MAX:
                raise S3Error("EntityTooLarge", f"a part may be at most {PART_BYTES_MAX} bytes")
            attr = await self.aio.close_file(rsp.attr.inode, rsp.session, n, exact=False)
            etag = md5.hexdigest()
            await self.store.write_record(attr.inode, {"etag": etag, "size": n})
            old = await self._stat_or_none(f"{d}/p{number:05d}")
            await self.aio.rename(temp, f"{d}/p{number:05d}")
        except BaseException:
            await self.store.discard(temp)
            raise
        if old is not None and old.inode != attr.inode:
            await self.store.drop_record(old.inode)
        return etag

    async def _stat_or_none(self, path: str):
        try:
            return await self.aio.stat(path)
        except FileNotFoundError:
            return None

    async def parts(self, bucket: str, upload_id: str) -> list[tuple[int, object, dict]]:
        """(number, attr, record) of every part, in order."""
        d = self._dir(bucket, upload_id)
        entries = await self.aio.listdir(d)
        names = sorted(e.name for e in entries if e.name.startswith("p") and e.name[1:].isdigit())
        attrs = await self.aio.batch_stat([f"{d}/{n}" for n in names]) if names else []
        good = [(int(n[1:]), a) for n, a in zip(names, attrs) if not isinstance(a, Exception)]
        records = []
        for i in range(0, len(good), 1000):
            records += await self.store.read_records([a.inode for _, a in good[i:i + 1000]])
        return [(n, a, r or {}) for (n, a), r in zip(good, records)]

    async def abort(self, bucket: str, key: str, upload_id: str) -> None:
        await self.info(bucket, key, upload_id)
        for _, attr, _ in await self.parts(bucket, upload_id):
            await self.store.drop_record(attr.inode)
        await self.aio.remove(self._dir(bucket, upload_id), recursive=True)

    async def uploads(self, bucket: str) -> list[tuple[str, str, dict]]:
        """(key, upload id, info) of the bucket's uploads, by key then time."""
        try:
            entries = await self.aio.listdir(self._dir(bucket))
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            try:
                info = await self.info(bucket, "", e.name)
            except S3Error:
                continue
            out.append((info["key"], e.name, info))
        out.sort(key=lambda x: (x[0], x[2]["initiated"]))
        return out

    def check_list(self, wanted: list[tuple[int, str]], have: dict[int, tuple]) -> list[tuple]:
        """The parts Complete names, checked: ascending numbers, known ETags, 5 MiB minimum."""
        if not wanted:
            raise S3Error("MalformedXML", "CompleteMultipartUpload names no parts")
        chosen, last = [], 0
        for number, etag in wanted:
            if number <= last:
                raise S3Error("InvalidPartOrder", "the list of parts was not in ascending order")
            last = number
            part = have.get(number)
            if part is None or part[2].get("etag") != etag.strip('"'):
                raise S3Error("InvalidPart", f"part {number} was not uploaded, or its ETag does not match",
                              PartNumber=str(number), ETag=etag)
            chosen.append(part)
        for n, attr, _ in chosen[:-1]:
            if attr.length < PART_BYTES_MIN:
                raise S3Error("EntityTooSmall", "your proposed upload is smaller than the minimum allowed "
                              f"object size (part {n} has {attr.length} bytes; parts but the last need 5 MiB)",
                              ProposedSize=str(attr.length), MinSizeAllowed=str(PART_BYTES_MIN),
                              PartNumber=str(n))
        return chosen

    async def complete(self, bucket: str, key: str, upload_id: str, wanted: list[tuple[int, str]], cred,
                       if_none_match: bool = False) -> tuple[str, object]:
        info = await self.info(bucket, key, upload_id)
        have = {n: (n, a, r) for n, a, r in await self.parts(bucket, upload_id)}
        chosen = self.check_list(wanted, have)
        etag = hashlib.md5(b"".join(bytes.fromhex(r["etag"]) for _, _, r in chosen)).hexdigest() \
            + f"-{len(chosen)}"
        record = dict(info["record"], etag=etag, parts=[a.length for _, a, _ in chosen])
        temp, rsp = await self.store.new_temp(cred, record)
        try:
            length = 0
            for _, attr, r in chosen:
                src = _Source(key, attr)
                length += await self.store.copy_data(src, 0, attr.length, rsp, [], base=length)
        except BaseException:
            await self.store.discard(temp)
            raise
        attr = await self.store.publish(temp, rsp, length, record, bucket, key, cred, if_none_match)
        await self.abort(bucket, key, upload_id)
        return etag, attr


class _Source:
    """What Store.read_stream needs of an object."""

    def __init__(self, key: str, attr):
        self.key, self.attr = key, attr

