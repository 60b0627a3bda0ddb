"""The S3 gateway as an ASGI application (served by uvicorn with httptools and uvloop).

Stateless: everything is in threefs (objects, records, uploads, keys), so any number of gateways on
any hosts serve the same buckets. `read_only=True` refuses every request that would change something.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import time
import uuid

from threefs.client import UserCred
from threefs.common.status import ThreeFSError
from threefs.s3 import acl, cors, lifecycle, sigv4, tagging, xmlout
from threefs.s3.errors import S3Error, from_threefs
from threefs.s3.http import Request, Response
from threefs.s3.keys import KeyStore
from threefs.s3.multipart import Multipart
from threefs.s3.multipart_api import MultipartHandlers
from threefs.s3.rules import (
    _check_conditions,
    _check_copy_conditions,
    _children,
    _copy_source,
    _etag_matches,
    _object_headers,
    _parse_range,
    _parse_xml,
    _part_range,
    _text,
)
from threefs.s3.store import Store

log = logging.getLogger("threefs.s3")

STORED_HEADERS = ("cache-control", "content-disposition", "content-encoding", "content-language", "expires")
USER_META_BYTES_MAX = 2048
BUCKET_TAGS_MAX = 50  # S3's limit for a bucket (objects: 10)
SWEEP_INTERVAL_S = 3600.0
RESPONSE_OVERRIDES = {"response-content-type": "content-type", "response-content-language": "content-language",
                      "response-expires": "expires", "response-cache-control": "cache-control",
                      "response-content-disposition": "content-disposition",
                      "response-content-encoding": "content-encoding"}


class Gateway(MultipartHandlers):
    def __init__(self, config, root: str = "/", read_only: bool = False, region: str = "us-east-1"):
        self.config, self.root = config, root
        self.read_only = read_only
        self.region = region
        self.aio = None  # made at start-up, inside the serving event loop

    async def start(self) -> None:
        from threefs.client.aio import AsyncClient

        self.aio = AsyncClient(self.config)
        await self.aio.start()
        self.store = Store(self.aio, self.root)
        self.multipart = Multipart(self.store)
        self.keys = KeyStore(self.aio, f"{self.store.sys}/keys", self.config.token)
        await self.store.setup()
        self._sweeper = asyncio.ensure_future(self._sweep_loop())
        self._lifecycle = asyncio.ensure_future(self._lifecycle_loop())

    async def _sweep_loop(self) -> None:
        """Remove what crashed PUTs left in .s3/tmp (runs until shutdown cancels it)."""
        while True:
            try:
                removed = await self.store.sweep_temp()
                if removed:
                    log.info("removed %d abandoned temp files", removed)
            except ThreeFSError as e:
                log.warning("temp sweep failed: %s", e)
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def _lifecycle_loop(self) -> None:
        """Expire objects and abort uploads as buckets' lifecycle rules say (see lifecycle.py)."""
        while True:
            await asyncio.sleep(lifecycle.LIFECYCLE_INTERVAL_S)
            if self.read_only:
                continue
            try:
                done = await lifecycle.sweep(self.store, self.multipart, time.time())
                if done["expired"] or done["aborted"]:
                    log.info("lifecycle: %d objects expired, %d uploads aborted in %d buckets",
                             done["expired"], done["aborted"], done["buckets"])
            except (ThreeFSError, S3Error) as e:
                log.warning("lifecycle pass failed (next one in %.0f s): %s", lifecycle.LIFECYCLE_INTERVAL_S, e)
            except Exception:  # a bug: say so, and keep the loop (the next pass may succeed)
                log.exception("lifecycle pass failed")

    # -- ASGI --------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        req = Request(scope, receive)
        request_id = uuid.uuid4().hex[:16].upper()
        try:
            rsp = await self.handle(req)
        except S3Error as e:
            rsp = self._error(req, e, request_id)
        except ThreeFSError as e:
            rsp = self._error(req, from_threefs(e, req.resource), request_id)
        except Exception as e:  # a bug: answer 500 and keep serving
            log.exception("internal error on %s %s", req.method, req.resource)
            rsp = self._error(req, S3Error("InternalError", f"{type(e).__name__}: {e}", 500), request_id)
        if req.header("origin") and req.bucket and req.method != "OPTIONS":
            rsp.headers = {**rsp.headers, **await self._cors_headers(req)}  # (headers may be shared)
        await self._send(send, req, rsp, request_id)

    async def _lifespan(self, receive, send):
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as e:
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                for task in (getattr(self, "_sweeper", None), getattr(self, "_lifecycle", None)):
                    if task is not None:
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                if self.aio is not None:
                    await self.aio.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _error(self, req: Request, e: S3Error, request_id: str) -> Response:
        body = b"" if req.method == "HEAD" else e.xml(req.resource, request_id)
        headers = {"content-type": "application/xml"}
        if e.code == "InvalidRange" and "size" in e.extra:
            headers["content-range"] = f"bytes */{e.extra.pop('size')}"
            body = b"" if req.method == "HEAD" else e.xml(req.resource, request_id)
        if e.status == 304:
            body = b""
            headers.update(e.extra)
        headers["x-amz-error-code"] = e.code
        return Response(e.status, headers, body)

    async def _send(self, send, req: Request, rsp: Response, request_id: str) -> None:
        headers = dict(rsp.headers)
        headers["x-amz-request-id"] = request_id
        headers.setdefault("server", "threefs-s3")
        if rsp.stream is None:
            headers["content-length"] = str(len(rsp.body) if req.method != "HEAD" or "content-length"
                                             not in headers else headers["content-length"])
        elif rsp.length is not None:
            headers["content-length"] = str(rsp.length)
        if not req.body_done and req.method in ("PUT", "POST") and rsp.status >= 400:
            headers["connection"] = "close"  # the body was not (all) read: do not parse it as a request
        raw = [(k.encode("latin-1"), str(v).encode("latin-1", "replace")) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": rsp.status, "headers": raw})
        if rsp.stream is None:
            await send({"type": "http.response.body", "body": rsp.body if req.method != "HEAD" else b""})
            return
        try:
            async for piece in rsp.stream:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        except Exception:  # too late for an error response: cut the connection short
            log.exception("streaming %s failed", req.resource)
            raise
        await send({"type": "http.response.body", "body": b""})

    # -- auth ---------------------------------------------------------------------------------------
    async def authenticate(self, req: Request) -> bool:
        """Check the request's signature and set its user; False for an unsigned (anonymous) request."""
        secrets: dict[str, object] = {}

        def secret_of(access_key: str) -> str:
            value = secrets.get(access_key)
            if value is None:
                raise S3Error("InvalidAccessKeyId", "the AWS access key id you provided does not exist in "
                              "our records", AWSAccessKeyId=access_key)
            return value[0]

        access_key = _access_key_of(req)
        if access_key is not None:
            found = await self.keys.lookup(access_key)
            if found is not None:
                secrets[access_key] = found
        auth = sigv4.verify(req.method, req.canonical_paths, req.raw_query, req.headers, secret_of)
        if auth is None:
            auth = sigv4.verify_v2(req.method, req.canonical_paths[0], req.query, req.headers, secret_of)
        if auth is None:
            return False
        req.auth = auth
        req.access_key = auth.access_key
        _, cred, user = secrets[auth.access_key]
        req.cred = None if cred.uid == 0 else cred
        req.user = user
        req.uid = cred.uid
        return True

    # -- dispatch -------------------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response:
        try:
            req.bucket.encode("utf-8")
        except UnicodeEncodeError:
            raise S3Error("InvalidURI", "couldn't parse the specified URI: not valid UTF-8") from None
        if req.method == "OPTIONS":
            return await self.preflight(req)
        if req.method == "POST" and req.bucket and not req.key and not req.query \
                and req.header("content-type").startswith("multipart/form-data"):
            return await self.post_object(req)  # a browser upload: its signed policy is the auth
        if not await self.authenticate(req):
            return await self.anonymous(req)
        if self.read_only and req.method not in ("GET", "HEAD"):
            raise S3Error("AccessDenied", "this gateway is read-only (threefs s3 serve --read-only); send "
                          "writes to a read-write gateway")
        if not req.bucket:
            if req.method == "GET":
                buckets = await self.store.list_buckets(req.cred)
                return Response(200, _XML, xmlout.list_buckets(buckets, req.uid, req.user))
            raise S3Error("MethodNotAllowed", "only GET is allowed on the service")
        if not req.key:
            return await self.bucket_op(req)
        return await self.object_op(req)

    async def bucket_op(self, req: Request) -> Response:
        q, m, b = req.query, req.method, req.bucket
        sub = next((s for s in _BUCKET_SUBRESOURCES if s in q), None)
        if sub is not None:
            return await self.bucket_subresource(req, sub)
        if m == "PUT":
            canned = acl.canned(req, acl.BUCKET_MODES)
            await req.read_small()
            await self.store.create_bucket(b, req.cred)
            if canned is not None:
                await self.set_bucket_acl(b, canned, req.cred)
            return Response(200, {"location": "/" + b})
        if m == "DELETE":
            if await self.multipart.uploads(b):
                raise S3Error("BucketNotEmpty", "the bucket has multipart uploads in progress", BucketName=b)
            await self.store.delete_bucket(b, req.cred)
            return Response(204)
        if m == "HEAD":
            from threefs.s3.store import may

            if not may(await self.store.bucket_attr(b, req.cred), req.cred, 1):
                raise S3Error("AccessDenied", f"bucket {b} is not accessible to this key's user")
            return Response(200, {"x-amz-bucket-region": self.region})
        if m == "GET":
            return await self.list_objects(req)
        if m == "POST" and "delete" in q:
            return await self.delete_objects(req)
        raise S3Error("MethodNotAllowed", f"{m} is not allowed on a bucket")

    async def bucket_subresource(self, req: Request, sub: str) -> Response:
        b, m = req.bucket, req.method
        if sub == "delete" and m == "POST":
            return await self.delete_objects(req)
        if sub in ("tagging", "cors", "lifecycle"):
            return await self.bucket_config_op(req, sub)
        if sub == "acl":
            return await self.bucket_acl(req)
        await self.store.bucket_attr(b, req.cred)
        if sub == "uploads" and m == "GET":
            return await self.list_uploads(req)
        if sub == "versions" and m == "GET":
            return await self.list_versions(req)
        if m == "GET":
            if sub == "location":
                return Response(200, _XML, xmlout.simple("LocationConstraint"))
            if sub == "versioning":
                return Response(200, _XML, xmlout.simple("VersioningConfiguration"))
            if sub == "policy":
                raise S3Error("NoSuchBucketPolicy", "the bucket policy does not exist")
            if sub == "encryption":
                raise S3Error("ServerSideEncryptionConfigurationNotFoundError", "no server-side encryption")
        raise S3Error("NotImplemented", f"the bucket sub-resource {sub!r} is not implemented for {m}", 501)

    # -- ACLs (threefs/s3/acl.py) and anonymous requests -------------------------------------------
    def _owner_name(self, req: Request, uid: int) -> str:
        return req.user if uid == req.uid else ("root" if uid == 0 else f"uid {uid}")

    async def bucket_acl(self, req: Request) -> Response:
        b = req.bucket
        if req.method == "GET":
            attr, public = await self.store.bucket_config(b, "acl", req.cred)
            return Response(200, _XML, acl.policy_xml(attr.uid, self._owner_name(req, attr.uid), attr.mode,
                                                      public, is_dir=True))
        if req.method != "PUT":
            raise S3Error("MethodNotAllowed", f"{req.method} is not allowed on a bucket's acl")
        canned = acl.canned(req, acl.BUCKET_MODES)
        body = await req.read_small()
        attr = await self.store.bucket_attr(b, req.cred)
        if canned is None:
            canned = acl.from_policy(body, attr.uid, acl.BUCKET_MODES)
        await self.set_bucket_acl(b, canned, req.cred)
        return Response(200)

    async def set_bucket_acl(self, bucket: str, canned: str, cred) -> None:
        """The bucket directory's mode, and whether anonymous requests may use it (owner only)."""
        await self.store.set_bucket_config(bucket, "acl", canned if canned in acl.PUBLIC else None, cred,
                                           mode=acl.BUCKET_MODES[canned])

    async def object_acl(self, req: Request) -> Response:
        b, k = req.bucket, req.key
        if req.method == "GET":
            info = await self.store.head(b, k, req.cred)
            return Response(200, _XML, acl.policy_xml(info.attr.uid, self._owner_name(req, info.attr.uid),
                                                      info.attr.mode, info.record.get("acl"), is_dir=False))
        if req.method != "PUT":
            raise S3Error("MethodNotAllowed", f"{req.method} is not allowed on an object's acl")
        canned = acl.canned(req, acl.OBJECT_MODES)
        body = await req.read_small()
        info = await self.store.head(b, k, req.cred)
        if canned is None:
            canned = acl.from_policy(body, info.attr.uid, acl.OBJECT_MODES)
        await self.store.chmod_object(info, acl.OBJECT_MODES[canned], req.cred)  # the owner's (threefs checks)
        record = dict(info.record, acl=canned)
        if record != info.record:
            await self.store.replace_record(info, record)
        return Response(200)

    async def anonymous(self, req: Request) -> Response:
        """An unsigned request: served only where an S3 ACL made the bucket or object public (never
        because of POSIX modes alone); the gateway then acts for the bucket's owner."""
        denied = S3Error("AccessDenied", "anonymous access is not allowed here: sign requests with an access "
                         "key from `threefs admin s3-key-add`, or make the bucket or object public with an ACL")
        q, m, b = req.query, req.method, req.bucket
        if not b or any(s in q for s in _BUCKET_SUBRESOURCES + _OBJECT_UNSUPPORTED + ("acl", "uploadId")):
            raise denied
        if self.read_only and m not in ("GET", "HEAD"):
            raise denied
        bucket_attr, public = await self.store.bucket_config(b, "acl", None)
        req.user, req.uid = "anonymous", acl.ANONYMOUS_UID
        if not req.key:
            if m in ("GET", "HEAD") and public in acl.PUBLIC:
                if m == "HEAD":
                    return Response(200, {"x-amz-bucket-region": self.region})
                return await self.list_objects(req)
            raise denied
        if m in ("GET", "HEAD"):
            try:
                info = await self.store.readable(b, req.key, None)
            except S3Error as e:  # whether a key exists is for those who may list the bucket
                if e.code == "NoSuchKey" and public not in acl.PUBLIC:
                    raise denied from None
                raise
            if info.record.get("acl") not in acl.PUBLIC:
                raise denied
            return self.serve_object(req, info)
        if m in ("PUT", "DELETE") and public == "public-read-write" and not req.header("x-amz-copy-source"):
            owner = bucket_attr.uid
            req.cred = None if owner == 0 else UserCred(owner, bucket_attr.gid)
            if m == "DELETE":
                await self.store.delete(b, req.key, req.cred)
                return Response(204)
            return await self.put_object(req)
        raise denied

    async def bucket_config_op(self, req: Request, kind: str) -> Response:
        """Get/Put/Delete of a bucket's tagging, CORS and lifecycle configurations (the owner's to change)."""
        b, m = req.bucket, req.method
        if m == "GET":
            _, value = await self.store.bucket_config(b, kind, req.cred)
            if value is None:
                code, what = {"cors": ("NoSuchCORSConfiguration", "CORS configuration"),
                              "lifecycle": ("NoSuchLifecycleConfiguration", "lifecycle configuration"),
                              "tagging": ("NoSuchTagSet", "TagSet")}[kind]
                raise S3Error(code, f"The {what} does not exist", BucketName=b)
            out = {"cors": cors.to_xml, "lifecycle": lifecycle.to_xml, "tagging": tagging.to_xml}[kind]
            return Response(200, _XML, out(value))
        if m == "PUT":
            body = await req.read_small()
            if kind == "cors":
                value = cors.from_xml(body)
            elif kind == "lifecycle":
                value = lifecycle.from_xml(body)
            else:
                value = tagging.from_xml(body, limit=BUCKET_TAGS_MAX)
            await self.store.set_bucket_config(b, kind, value or None, req.cred)
            return Response(204 if kind == "tagging" else 200)
        if m == "DELETE":
            await self.store.set_bucket_config(b, kind, None, req.cred)
            return Response(204)
        raise S3Error("MethodNotAllowed", f"{m} is not allowed on a bucket's {kind}")

    async def preflight(self, req: Request) -> Response:
        """An OPTIONS preflight (unauthenticated, as browsers send it), judged by the bucket's CORS rules."""
        origin, method = req.header("origin"), req.header("access-control-request-method")
        if not origin:
            raise S3Error("BadRequest", "Insufficient information. Origin request header needed.")
        if not method:
            raise S3Error("BadRequest", "Invalid Access-Control-Request-Method: (none given)")
        if not req.bucket:
            raise S3Error("AccessForbidden", "CORSResponse: Bucket not found", 403)
        _, rules = await self.store.bucket_config(req.bucket, "cors", None)
        if not rules:
            raise S3Error("AccessForbidden", "CORSResponse: This CORS request is not allowed. This is usually "
                          "because the evalution of Origin, request method / Access-Control-Request-Method or "
                          "Access-Control-Request-Headers are not whitelisted by the resource's CORS spec.", 403,
                          Method=method, ResourceType="OBJECT" if req.key else "BUCKET")
        wanted = cors.requested_headers(req.header("access-control-request-headers"))
        rule = cors.match(rules, origin, method, wanted)
        if rule is None:
            raise S3Error("AccessForbidden", "CORSResponse: This CORS request is not allowed. This is usually "
                          "because the evalution of Origin, request method / Access-Control-Request-Method or "
                          "Access-Control-Request-Headers are not whitelisted by the resource's CORS spec.", 403,
                          Method=method, ResourceType="OBJECT" if req.key else "BUCKET")
        return Response(200, cors.response_headers(rule, origin, wanted))

    async def _cors_headers(self, req: Request) -> dict:
        """Access-Control-* headers for a request with an Origin, from its bucket's rules (none if the
        bucket has no rule for it, or cannot be read)."""
        try:
            _, rules = await self.store.bucket_config(req.bucket, "cors", None)
        except (S3Error, ThreeFSError):
            return {}
        rule = cors.match(rules or [], req.header("origin"), req.method)
        return {} if rule is None else cors.response_headers(rule, req.header("origin"))

    async def object_op(self, req: Request) -> Response:
        q, m = req.query, req.method
        sub = next((s for s in _OBJECT_UNSUPPORTED if s in q), None)
        if sub is not None:
            raise S3Error("NotImplemented", f"the object sub-resource {sub!r} is not implemented", 501)
        if q.get("versionId", "null") != "null":  # buckets are unversioned: every object is version "null"
            raise S3Error("InvalidArgument", "Invalid version id specified", ArgumentName="versionId",
                          ArgumentValue=q["versionId"])
        if "acl" in q:
            return await self.object_acl(req)
        if "tagging" in q:
            return await self.object_tagging(req)
        if "uploadId" in q:
            return await self.multipart_op(req)
        if m == "POST" and "uploads" in q:
            return await self.create_upload(req)
        if m == "PUT":
            if req.header("x-amz-copy-source"):
                return await self.copy_object(req)
            return await self.put_object(req)
        if m in ("GET", "HEAD"):
            return await self.get_object(req)
        if m == "DELETE":
            await self.store.delete(req.bucket, req.key, req.cred)
            return Response(204)
        raise S3Error("MethodNotAllowed", f"{m} is not allowed on an object")

    # -- objects ------------------------------------------------------------------------------------
    async def object_tagging(self, req: Request) -> Response:
        """Get/Put/DeleteObjectTagging: the tag set in the object's record (see threefs/s3/tagging.py).
        Changing tags needs the right to write into the bucket, as a PUT does."""
        m, b, k = req.method, req.bucket, req.key
        if m == "GET":
            info = await self.store.readable(b, k, req.cred)
            return Response(200, _XML, tagging.to_xml(info.record.get("tags") or []))
        if m not in ("PUT", "DELETE"):
            raise S3Error("MethodNotAllowed", f"{m} is not allowed on an object's tagging")
        tags = tagging.from_xml(await req.read_small()) if m == "PUT" else []
        from threefs.s3.store import may

        if not may(await self.store.bucket_attr(b, req.cred), req.cred, 3):
            raise S3Error("AccessDenied", f"changing the tags of {k} needs write access to bucket {b}")
        info = await self.store.head(b, k, req.cred)
        record = dict(info.record)
        if tags:
            record["tags"] = tags
        else:
            record.pop("tags", None)
        if not info.record and not tags:
            return Response(204)  # written outside the gateway and untagged: nothing to store
        await self.store.replace_record(info, record)
        return Response(200 if m == "PUT" else 204)

    def _record_from_headers(self, req: Request) -> dict:
        meta = {}
        size = 0
        for name, values in req.headers.items():
            if name.startswith("x-amz-meta-"):
                meta[name[11:]] = ",".join(values)
                size += len(name) - 11 + len(meta[name[11:]])
        if size > USER_META_BYTES_MAX:
            raise S3Error("MetadataTooLarge", f"user metadata may be at most {USER_META_BYTES_MAX} bytes",
                          MaxSizeAllowed=str(USER_META_BYTES_MAX))
        stored = {h: req.header(h) for h in STORED_HEADERS if req.header(h)}
        if "content-encoding" in stored:
            enc = ",".join(e for e in stored["content-encoding"].split(",") if e.strip() != "aws-chunked")
            if enc:
                stored["content-encoding"] = enc
            else:
                del stored["content-encoding"]
        record = {"ct": req.header("content-type", "binary/octet-stream"), "meta": meta, "h": stored}
        canned = acl.canned(req, acl.OBJECT_MODES)
        if canned is not None:
            record["acl"] = canned
        if req.header("x-amz-tagging"):
            tags = tagging.from_header(req.header("x-amz-tagging"))
            if tags:
                record["tags"] = tags
        return record

    async def put_object(self, req: Request) -> Response:
        b, k = req.bucket, req.key
        self.store.object_paths(b, k)
        await self.store.check_bucket(b, req.cred)
        if not req.header("content-length") and not req.header("x-amz-decoded-content-length") \
                and "chunked" not in req.header("transfer-encoding"):
            raise S3Error("MissingContentLength", "you must provide the Content-Length HTTP header")
        record = self._record_from_headers(req)
        if_match = req.header("if-match")
        if if_match:
            current = await self.store.head(b, k, req.cred) if if_match != "*" else None
            if current is None:
                await self.store.head(b, k, req.cred)
            elif not _etag_matches(if_match, current.etag):
                raise S3Error("PreconditionFailed", "At least one of the pre-conditions you specified did "
                              "not hold", Condition="If-Match")
        temp, rsp = await self.store.new_temp(req.cred, record)
        record_file = asyncio.ensure_future(self.store.create_record(rsp.attr.inode))  # while data arrives
        md5 = hashlib.md5()
        try:
            length = await self.store.write_stream(rsp, req.body(), [md5])
        except BaseException:
            await asyncio.gather(record_file, return_exceptions=True)
            await self.store.discard(temp)
            await self.store.drop_record(rsp.attr.inode)
            raise
        record["etag"] = md5.hexdigest()
        await self.store.publish(temp, rsp, length, record, b, k, req.cred,
                                 if_none_match=req.header("if-none-match") == "*", record_file=record_file)
        headers = {"etag": f'"{record["etag"]}"'}
        for h in req.headers:
            if h.startswith("x-amz-checksum-") and h not in ("x-amz-checksum-algorithm", "x-amz-checksum-type"):
                headers[h] = req.header(h)
        return Response(200, headers)

    async def get_object(self, req: Request) -> Response:
        return self.serve_object(req, await self.store.readable(req.bucket, req.key, req.cred))

    def serve_object(self, req: Request, info) -> Response:
        headers = _object_headers(info)
        _check_conditions(req, info, headers)
        for q, h in RESPONSE_OVERRIDES.items():
            if q in req.query:
                headers[h] = req.query[q]
        size = info.size
        part = req.query.get("partNumber")
        rng = req.header("range")
        if part:
            rng = _part_range(info, part)
            headers["x-amz-mp-parts-count"] = str(len(info.record.get("parts") or [1]))
        if rng:
            start, end = _parse_range(rng, size)
            if start is not None:
                headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
                headers["content-length"] = str(end - start)
                if req.method == "HEAD":
                    return Response(206, headers)
                return Response(206, headers, stream=self.store.read_stream(info, start, end), length=end - start)
        headers["content-length"] = str(size)
        if req.method == "HEAD" or size == 0:
            return Response(200, headers, b"")
        return Response(200, headers, stream=self.store.read_stream(info, 0, size), length=size)

    async def copy_object(self, req: Request) -> Response:
        src_bucket, src_key = _copy_source(req.header("x-amz-copy-source"))
        src = await self.store.readable(src_bucket, src_key, req.cred)
        _check_copy_conditions(req, src)
        directive = req.header("x-amz-metadata-directive", "COPY").upper()
        if directive not in ("COPY", "REPLACE"):
            raise S3Error("InvalidArgument", "x-amz-metadata-directive must be COPY or REPLACE")
        await self.store.bucket_attr(req.bucket, req.cred)
        tag_directive = req.header("x-amz-tagging-directive", "COPY").upper()
        if tag_directive not in ("COPY", "REPLACE"):
            raise S3Error("InvalidArgument", "x-amz-tagging-directive must be COPY or REPLACE",
                          ArgumentName="x-amz-tagging-directive", ArgumentValue=tag_directive)
        if directive == "REPLACE":
            record = self._record_from_headers(req)
            record.pop("tags", None)
        else:
            record = {k: v for k, v in src.record.items() if k in ("ct", "meta", "h")}
            canned = acl.canned(req, acl.OBJECT_MODES)  # a copy gets the ACL asked for, not its source's
            if canned is not None:
                record["acl"] = canned
        tags = (tagging.from_header(req.header("x-amz-tagging")) if tag_directive == "REPLACE"
                else src.record.get("tags"))
        if tags:
            record["tags"] = tags
        record["etag"] = src.etag
        if "parts" in src.record:
            record["parts"] = src.record["parts"]
        same = (src_bucket, src_key) == (req.bucket, req.key)
        if same and directive == "COPY":
            raise S3Error("InvalidRequest", "This copy request is illegal because it is trying to copy an "
                          "object to itself without changing the object's metadata, storage class, website "
                          "redirect location or encryption attributes.")
        if same:  # a metadata update: replace the record only (atomically)
            if "acl" in record:
                await self.store.chmod_object(src, acl.OBJECT_MODES[record["acl"]], req.cred)
            elif "acl" in src.record:
                record["acl"] = src.record["acl"]
            mtime = await self.store.replace_metadata(src, record)
            return Response(200, _XML, xmlout.copy_result("CopyObjectResult", src.etag, mtime))
        temp, rsp = await self.store.new_temp(req.cred, record)
        try:
            length = await self.store.copy_data(src, 0, src.size, rsp, [])
        except BaseException:
            await self.store.discard(temp)
            raise
        attr = await self.store.publish(temp, rsp, length, record, req.bucket, req.key, req.cred)
        return Response(200, _XML, xmlout.copy_result("CopyObjectResult", src.etag, attr.mtime_ns / 1e9))

    async def post_object(self, req: Request) -> Response:
        from threefs.s3 import post

        boundary = req.header("content-type").partition("boundary=")[2].strip().strip('"')
        if not boundary:
            raise S3Error("MalformedPOSTRequest", "multipart/form-data without a boundary")
        req.body_used = True
        form = post.FormReader(req._raw_body(), boundary)
        fields, filename, file_type = await form.fields()
        lower = {k.lower(): v for k, v in fields.items()}
        access_key = lower.get("awsaccesskeyid") or lower.get("x-amz-credential", "").split("/", 1)[0]
        found = await self.keys.lookup(access_key) if access_key else None

        def secret_of(k: str) -> str:
            if found is None:
                raise S3Error("InvalidAccessKeyId", "the AWS access key id you provided does not exist in our "
                              "records", AWSAccessKeyId=k)
            return found[0]

        _, length_range = post.check_policy(fields, req.bucket, secret_of)
        if self.read_only:
            raise S3Error("AccessDenied", "this gateway is read-only")
        cred = None if found[1].uid == 0 else found[1]
        if "key" not in lower:
            raise S3Error("InvalidArgument", "Bucket POST must contain a field named 'key'", ArgumentName="key")
        key = lower["key"].replace("${filename}", filename)
        self.store.object_paths(req.bucket, key)
        await self.store.check_bucket(req.bucket, cred)
        record = self._record_from_fields(lower, file_type)
        temp, rsp = await self.store.new_temp(cred, record)
        md5 = hashlib.md5()
        try:
            length = await self.store.write_stream(rsp, form.file_body(), [md5])
            if length_range and not length_range[0] <= length <= length_range[1]:
                code = "EntityTooSmall" if length < length_range[0] else "EntityTooLarge"
                raise S3Error(code, f"your upload of {length} bytes is outside the policy's content-length-range "
                              f"{length_range}")
        except BaseException:
            await self.store.discard(temp)
            raise
        record["etag"] = md5.hexdigest()
        await self.store.publish(temp, rsp, length, record, req.bucket, key, cred)
        return _post_response(req, lower, key, record["etag"])

    def _record_from_fields(self, lower: dict, file_type: str) -> dict:
        meta = {k[11:]: v for k, v in lower.items() if k.startswith("x-amz-meta-")}
        stored = {h: lower[h] for h in STORED_HEADERS if lower.get(h)}
        record = {"ct": lower.get("content-type") or "binary/octet-stream", "meta": meta, "h": stored}
        if lower.get("acl"):
            if lower["acl"] not in acl.OBJECT_MODES:
                raise S3Error("InvalidArgument", f"acl {lower['acl']!r} is not one of "
                              f"{', '.join(sorted(acl.OBJECT_MODES))}", ArgumentName="acl")
            record["acl"] = lower["acl"]
        if lower.get("tagging"):
            record["tags"] = tagging.from_xml(lower["tagging"].encode())
        return record

    async def delete_objects(self, req: Request) -> Response:
        await self.store.bucket_attr(req.bucket, req.cred)
        root = _parse_xml(await req.read_small())
        quiet = (_text(root, "Quiet") or "false").lower() == "true"
        keys = [_text(o, "Key") for o in _children(root, "Object")]
        if len(keys) > 1000:
            raise S3Error("MalformedXML", "DeleteObjects takes at most 1000 keys")
        deleted, errors = [], []
        for key in keys:
            try:
                await self.store.delete(req.bucket, key or "", req.cred)
                deleted.append(key)
            except S3Error as e:
                errors.append((key or "", e.code, e.message))
        return Response(200, _XML, xmlout.delete_result(deleted, errors, quiet))

    async def list_objects(self, req: Request) -> Response:
        q = req.query
        v2 = q.get("list-type") == "2"
        prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
        url = q.get("encoding-type") == "url"
        try:
            max_keys = min(1000, int(q.get("max-keys", "1000")))
        except ValueError:
            raise S3Error("InvalidArgument", "max-keys must be an integer", ArgumentName="max-keys") from None
        if max_keys < 0:
            raise S3Error("InvalidArgument", "max-keys must be >= 0", ArgumentName="max-keys")
        own = xmlout.owner(req.uid, req.user)
        if v2:
            token = q.get("continuation-token")
            start_after = q.get("start-after", "")
            after = start_after
            if token is not None:
                try:
                    after = base64.urlsafe_b64decode(token.encode()).decode()
                except (binascii.Error, UnicodeDecodeError, ValueError):
                    raise S3Error("InvalidArgument", "the continuation token is not valid",
                                  ArgumentName="continuation-token") from None
            page = await self.store.list(req.bucket, req.cred, prefix, delimiter, after, max_keys)
            next_token = base64.urlsafe_b64encode(page.last.encode()).decode() if page.truncated else ""
            body = xmlout.list_v2(req.bucket, page, prefix, delimiter, max_keys, url, start_after, token,
                                  next_token, q.get("fetch-owner") == "true", own)
        else:
            marker = q.get("marker", "")
            page = await self.store.list(req.bucket, req.cred, prefix, delimiter, marker, max_keys)
            body = xmlout.list_v1(req.bucket, page, prefix, delimiter, max_keys, url, marker, own)
        return Response(200, _XML, body)

    async def list_versions(self, req: Request) -> Response:
        """Buckets are never versioned: every object is its only, latest version ("null")."""
        q = req.query
        prefix, delimiter = q.get("prefix", ""), q.get("delimiter", "")
        max_keys = min(1000, int(q.get("max-keys", "1000") or 1000))
        page = await self.store.list(req.bucket, req.cred, prefix, delimiter, q.get("key-marker", ""), max_keys)
        url = q.get("encoding-type") == "url"
        from threefs.s3.http import iso_date

        own = xmlout.owner(req.uid, req.user)
        items = "".join(f"<Version><Key>{xmlout._enc(k, url)}</Key><VersionId>null</VersionId><IsLatest>true"
                        f"</IsLatest><LastModified>{iso_date(t)}</LastModified><ETag>&quot;{e}&quot;</ETag>"
                        f"<Size>{size}</Size>{own}<StorageClass>STANDARD</StorageClass></Version>"
                        for k, size, t, e in page.contents)
        cps = "".join(f"<CommonPrefixes><Prefix>{xmlout._enc(p, url)}</Prefix></CommonPrefixes>"
                      for p in page.prefixes)
        nxt = (f"<NextKeyMarker>{xmlout._enc(page.last, url)}</NextKeyMarker><NextVersionIdMarker>null"
               "</NextVersionIdMarker>") if page.truncated else ""
        inner = (f"<Name>{_esc(req.bucket)}</Name><Prefix>{xmlout._enc(prefix, url)}</Prefix>"
                 f"<KeyMarker>{xmlout._enc(q.get('key-marker', ''), url)}</KeyMarker><VersionIdMarker>"
                 f"</VersionIdMarker><MaxKeys>{max_keys}</MaxKeys>"
                 + (f"<Delimiter>{xmlout._enc(delimiter, url)}</Delimiter>" if delimiter else "")
                 + f"<IsTruncated>{'true' if page.truncated else 'false'}</IsTruncated>{nxt}{items}{cps}")
        return Response(200, _XML, xmlout.simple("ListVersionsResult", inner))

    # -- multipart ---------------------------------------------------------------------------------
_XML = {"content-type": "application/xml"}
_OBJECT_UNSUPPORTED = ("attributes", "retention", "legal-hold", "restore", "select", "torrent")
_BUCKET_SUBRESOURCES = ("uploads", "versions", "location", "versioning", "acl", "tagging", "policy", "cors", "lifecycle",
                        "encryption", "delete", "website", "logging", "notification", "replication",
                        "requestPayment", "ownershipControls", "publicAccessBlock", "object-lock",
                        "accelerate", "analytics", "inventory", "metrics", "intelligent-tiering")


def _post_response(req: Request, lower: dict, key: str, etag: str) -> Response:
    from urllib.parse import quote

    headers = {"etag": f'"{etag}"', "location": f"/{req.bucket}/{quote(key)}"}
    redirect = lower.get("success_action_redirect") or lower.get("redirect")
    if redirect:
        sep = "&" if "?" in redirect else "?"
        headers["location"] = f"{redirect}{sep}bucket={quote(req.bucket)}&key={quote(key)}&etag=%22{etag}%22"
        return Response(303, headers)
    status = lower.get("success_action_status", "204")
    if status == "201":
        inner = (f"<Location>/{_esc(req.bucket)}/{_esc(key)}</Location><Bucket>{_esc(req.bucket)}</Bucket>"
                 f"<Key>{_esc(key)}</Key><ETag>&quot;{etag}&quot;</ETag>")
        return Response(201, dict(headers, **_XML), xmlout.simple("PostResponse", inner))
    return Response(200 if status == "200" else 204, headers)


def _esc(s: str) -> str:
    from xml.sax.saxutils import escape

    return escape(s)


def _access_key_of(req: Request) -> str | None:
    authz = req.header("authorization")
    if authz.startswith(sigv4.ALGORITHM):
        i = authz.find("Credential=")
        if i >= 0:
            return authz[i + 11:].split("/", 1)[0]
        return None
    if authz.startswith("AWS "):
        return authz[4:].split(":", 1)[0]
    if "AWSAccessKeyId" in req.query:
        return req.query["AWSAccessKeyId"]
    cred = req.query.get("X-Amz-Credential")
    return cred.split("/", 1)[0] if cred else None
