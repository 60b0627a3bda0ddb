"""The multipart-upload handlers of the gateway (a mixin of app.Gateway)."""

from __future__ import annotations

import asyncio
import os
import time
from xml.sax.saxutils import escape as _esc

from threefs.common.status import ThreeFSError
from threefs.s3 import xmlout
from threefs.s3.errors import S3Error, from_threefs
from threefs.s3.http import Request, Response
from threefs.s3.rules import (
    _check_copy_conditions,
    _children,
    _copy_source,
    _parse_range,
    _parse_xml,
    _text,
)

# CompleteMultipartUpload answers at once and sends whitespace after this long (tests set it tiny)
COMPLETE_KEEPALIVE_S = float(os.environ.get("THREEFS_S3_COMPLETE_KEEPALIVE_S", "5.0"))
_XML = {"content-type": "application/xml"}


class MultipartHandlers:
    async def create_upload(self, req: Request) -> Response:
        await self.store.bucket_attr(req.bucket, req.cred)
        upload_id = await self.multipart.create(req.bucket, req.key, req.cred, req.user,
                                                self._record_from_headers(req))
        inner = (f"<Bucket>{_esc(req.bucket)}</Bucket><Key>{_esc(req.key)}</Key>"
                 f"<UploadId>{upload_id}</UploadId>")
        return Response(200, _XML, xmlout.simple("InitiateMultipartUploadResult", inner))

    async def multipart_op(self, req: Request) -> Response:
        q, m = req.query, req.method
        upload_id = q["uploadId"]
        if m == "PUT":
            number = self.multipart.part_number(q.get("partNumber", ""))
            if req.header("x-amz-copy-source"):
                return await self.upload_part_copy(req, upload_id, number)

            async def fill(rsp, hashers):
                return await self.store.write_stream(rsp, req.body(), hashers)

            etag = await self.multipart.upload_part(req.bucket, req.key, upload_id, number, fill)
            return Response(200, {"etag": f'"{etag}"'})
        if m == "GET":
            return await self.list_parts(req, upload_id)
        if m == "DELETE":
            await self.multipart.abort(req.bucket, req.key, upload_id)
            return Response(204)
        if m == "POST":
            return await self.complete_upload(req, upload_id)
        raise S3Error("MethodNotAllowed", f"{m} is not allowed on an upload")

    async def upload_part_copy(self, req: Request, upload_id: str, number: int) -> Response:
        src_bucket, src_key = _copy_source(req.header("x-amz-copy-source"))
        src = await self.store.readable(src_bucket, src_key, req.cred)
        _check_copy_conditions(req, src)
        start, end = 0, src.size
        rng = req.header("x-amz-copy-source-range")
        if rng:
            start, end = _parse_range(rng, src.size)
            if start is None:
                raise S3Error("InvalidArgument", f"the copy source range {rng!r} is not valid")

        async def fill(rsp, hashers):
            return await self.store.copy_data(src, start, end, rsp, hashers)

        etag = await self.multipart.upload_part(req.bucket, req.key, upload_id, number, fill)
        return Response(200, _XML, xmlout.copy_result("CopyPartResult", etag, time.time()))

    async def list_parts(self, req: Request, upload_id: str) -> Response:
        info = await self.multipart.info(req.bucket, req.key, upload_id)
        parts = await self.multipart.parts(req.bucket, upload_id)
        try:
            marker = int(req.query.get("part-number-marker", "0") or 0)
            max_parts = min(1000, int(req.query.get("max-parts", "1000")))
        except ValueError:
            raise S3Error("InvalidArgument", "part-number-marker and max-parts must be integers") from None
        parts = [p for p in parts if p[0] > marker]
        truncated = len(parts) > max_parts
        parts = parts[:max_parts]
        from threefs.s3.http import iso_date

        items = "".join(f"<Part><PartNumber>{n}</PartNumber><LastModified>{iso_date(a.mtime_ns / 1e9)}"
                        f"</LastModified><ETag>&quot;{r.get('etag', '')}&quot;</ETag><Size>{a.length}</Size></Part>"
                        for n, a, r in parts)
        own = xmlout.owner(info["uid"], info["user"])
        inner = (f"<Bucket>{_esc(req.bucket)}</Bucket><Key>{_esc(req.key)}</Key><UploadId>{upload_id}</UploadId>"
                 f"<Initiator><ID>{info['uid']}</ID><DisplayName>{_esc(info['user'])}</DisplayName></Initiator>"
                 f"{own}<StorageClass>STANDARD</StorageClass><PartNumberMarker>{marker}</PartNumberMarker>"
                 f"<NextPartNumberMarker>{parts[-1][0] if parts else marker}</NextPartNumberMarker>"
                 f"<MaxParts>{max_parts}</MaxParts><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"
                 f"{items}")
        return Response(200, _XML, xmlout.simple("ListPartsResult", inner))

    async def list_uploads(self, req: Request) -> Response:
        prefix = req.query.get("prefix", "")
        uploads = [u for u in await self.multipart.uploads(req.bucket) if u[0].startswith(prefix)]
        key_marker = req.query.get("key-marker", "")
        if key_marker:
            uploads = [u for u in uploads if u[0] > key_marker]
        max_uploads = min(1000, int(req.query.get("max-uploads", "1000") or 1000))
        truncated = len(uploads) > max_uploads
        uploads = uploads[:max_uploads]
        from threefs.s3.http import iso_date

        items = "".join(
            f"<Upload><Key>{_esc(k)}</Key><UploadId>{uid}</UploadId><Initiator><ID>{i['uid']}</ID>"
            f"<DisplayName>{_esc(i['user'])}</DisplayName></Initiator>{xmlout.owner(i['uid'], i['user'])}"
            f"<StorageClass>STANDARD</StorageClass><Initiated>{iso_date(i['initiated'])}</Initiated></Upload>"
            for k, uid, i in uploads)
        nxt = (f"<NextKeyMarker>{_esc(uploads[-1][0])}</NextKeyMarker><NextUploadIdMarker>{uploads[-1][1]}"
               "</NextUploadIdMarker>") if truncated and uploads else ""
        inner = (f"<Bucket>{_esc(req.bucket)}</Bucket><KeyMarker>{_esc(key_marker)}</KeyMarker>"
                 f"<UploadIdMarker></UploadIdMarker>{nxt}<Prefix>{_esc(prefix)}</Prefix>"
                 f"<MaxUploads>{max_uploads}</MaxUploads><IsTruncated>{'true' if truncated else 'false'}"
                 f"</IsTruncated>{items}")
        return Response(200, _XML, xmlout.simple("ListMultipartUploadsResult", inner))

    async def complete_upload(self, req: Request, upload_id: str) -> Response:
        root = _parse_xml(await req.read_small())
        wanted = []
        for p in _children(root, "Part"):
            n, etag = _text(p, "PartNumber"), _text(p, "ETag")
            if not n or not n.isdigit() or etag is None:
                raise S3Error("MalformedXML", "each Part needs a PartNumber and an ETag")
            wanted.append((int(n), etag))
        task = asyncio.ensure_future(self.multipart.complete(
            req.bucket, req.key, upload_id, wanted, req.cred, req.header("if-none-match") == "*"))
        done, _ = await asyncio.wait([task], timeout=COMPLETE_KEEPALIVE_S)
        if done:
            etag, _ = task.result()
            return Response(200, _XML, self._complete_xml(req, etag))
        # a long copy: answer 200 now and keep the connection alive with whitespace, as S3 does;
        # an error after this point goes in the body (clients check CompleteMultipartUpload's body)
        return Response(200, _XML, stream=self._complete_stream(req, task))

    def _complete_xml(self, req: Request, etag: str) -> bytes:
        inner = (f"<Location>/{_esc(req.bucket)}/{_esc(req.key)}</Location><Bucket>{_esc(req.bucket)}</Bucket>"
                 f"<Key>{_esc(req.key)}</Key><ETag>&quot;{etag}&quot;</ETag>")
        return xmlout.simple("CompleteMultipartUploadResult", inner)

    async def _complete_stream(self, req: Request, task):
        """As S3: the XML declaration at once, whitespace while the copy runs, then the result (or
        the error) element. Clients parse the whole body, so an error here still reaches them."""
        yield xmlout.HEAD.encode()
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=COMPLETE_KEEPALIVE_S)
                if done:
                    break
                yield b" "
            try:
                etag, _ = task.result()
                body = self._complete_xml(req, etag)
            except S3Error as e:
                body = e.xml(req.resource)
            except ThreeFSError as e:
                body = from_threefs(e, req.key).xml(req.resource)
            yield body.split(b"?>", 1)[1].lstrip() if body.startswith(b"<?xml") else body
        finally:
            if not task.done():
                task.cancel()
