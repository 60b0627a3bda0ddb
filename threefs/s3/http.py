"""One S3 request as the handlers see it: parsed path, query, headers, verified body stream."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import time
from urllib.parse import quote, unquote

from threefs.s3 import sigv4
from threefs.s3.errors import S3Error

BODY_XML_BYTES_MAX = 2 << 20  # DeleteObjects / CompleteMultipartUpload bodies


class Request:
    def __init__(self, scope, receive):
        self.scope, self._receive = scope, receive
        self.method = scope["method"]
        self.raw_path = scope.get("raw_path") or scope["path"].encode()
        raw_path = self.raw_path.decode("latin-1").split("?", 1)[0]
        self.raw_query = scope.get("query_string", b"").decode("latin-1")
        self.headers: dict[str, list[str]] = {}
        for k, v in scope["headers"]:
            self.headers.setdefault(k.decode("latin-1").lower(), []).append(v.decode("latin-1"))
        self.query: dict[str, str] = {}
        for part in self.raw_query.split("&") if self.raw_query else []:
            k, _, v = part.partition("=")
            self.query[unquote(k.replace("+", " "))] = unquote(v.replace("+", " "))
        path = unquote(raw_path, errors="surrogateescape")
        self.canonical_paths = [raw_path or "/", quote(path.encode("utf-8", "surrogateescape"), safe="/-_.~") or "/"]
        self.bucket, self.key = "", ""
        stripped = path[1:] if path.startswith("/") else path
        if stripped:
            self.bucket, _, self.key = stripped.partition("/")
        self.auth: sigv4.Auth | None = None
        self.cred = None
        self.user = ""
        self.access_key = ""
        self.body_used = False
        self.body_done = False  # the whole body was received

    def header(self, name: str, default: str = "") -> str:
        v = self.headers.get(name)
        return v[0] if v else default

    @property
    def resource(self) -> str:
        return "/" + self.bucket + ("/" + self.key if self.key else "")

    # -- body -------------------------------------------------------------------------------------
    async def _raw_body(self):
        self.body_used = True
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                raise S3Error("IncompleteBody", "the client went away before sending the whole body")
            body = msg.get("body", b"")
            if body:
                yield body
            if not msg.get("more_body", False):
                self.body_done = True
                return

    async def body(self):
        """The payload as an async iterator of pieces, checked against its signature mode, the
        declared length, Content-MD5 (BadDigest) and trailing checksums; a failure raises after the
        last piece, before the caller makes anything visible."""
        auth = self.auth
        mode = auth.payload_hash if auth is not None else sigv4.UNSIGNED
        expected = self.header("x-amz-decoded-content-length") if mode.startswith("STREAMING-") \
            else self.header("content-length")
        md5_sent = self.header("content-md5")
        if "content-md5" in self.headers and not md5_sent:
            raise S3Error("InvalidDigest", "the Content-MD5 you specified is empty")
        md5 = hashlib.md5() if md5_sent else None
        sha = hashlib.sha256() if len(mode) == 64 else None
        decoder = None
        checksum_name = None
        if mode.startswith("STREAMING-") or "aws-chunked" in self.header("content-encoding"):
            if auth is None:
                raise S3Error("AccessDenied", "aws-chunked bodies need a signed request")
            decoder = sigv4.ChunkDecoder(auth)
            for t in self.header("x-amz-trailer").split(","):
                if t.strip():
                    decoder.expect_trailer(t)
        elif not mode.startswith("STREAMING-"):
            checksum_name = next((h for h in self.headers if h.startswith("x-amz-checksum-")
                                  and h != "x-amz-checksum-type" and h != "x-amz-checksum-algorithm"), None)
        n = 0
        checker = None
        if decoder is None and checksum_name in ("x-amz-checksum-crc32", "x-amz-checksum-crc32c",
                                                  "x-amz-checksum-sha1", "x-amz-checksum-sha256"):
            checker = sigv4.Checksum(checksum_name)
        async for raw in self._raw_body():
            pieces = decoder.feed(raw) if decoder is not None else (raw,)
            for piece in pieces:
                n += len(piece)
                if md5 is not None:
                    md5.update(piece)
                if sha is not None:
                    sha.update(piece)
                if checker is not None:
                    checker.update(piece)
                yield piece
        if decoder is not None:
            decoder.finish()
        if expected and expected.isdigit() and int(expected) != n:
            raise S3Error("IncompleteBody", f"you sent {n} bytes of {expected} declared")
        if sha is not None and sha.hexdigest() != mode:
            raise S3Error("XAmzContentSHA256Mismatch", "the provided x-amz-content-sha256 header does not "
                          "match what was computed", ClientComputedContentSHA256=mode,
                          S3ComputedContentSHA256=sha.hexdigest())
        if md5 is not None:
            try:
                sent = base64.b64decode(md5_sent, validate=True)
            except ValueError:
                raise S3Error("InvalidDigest", "the Content-MD5 you specified is not valid") from None
            if sent != md5.digest():
                raise S3Error("BadDigest", "the Content-MD5 you specified did not match what we received")
        if checker is not None and checker.value() != self.header(checker.name):
            raise S3Error("BadDigest", f"the {checker.name} you specified did not match what we received")

    async def read_small(self, limit: int = BODY_XML_BYTES_MAX) -> bytes:
        out = bytearray()
        async for piece in self.body():
            out += piece
            if len(out) > limit:
                raise S3Error("EntityTooLarge", f"this request's body may be at most {limit} bytes")
        return bytes(out)


class Response:
    def __init__(self, status: int = 200, headers: dict | None = None, body: bytes = b"", stream=None,
                 length: int | None = None):
        self.status, self.headers, self.body, self.stream, self.length = status, headers or {}, body, stream, length


def http_date(t: float) -> str:
    return email.utils.formatdate(t, usegmt=True)


def iso_date(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def parse_http_date(text: str) -> float | None:
    try:
        dt = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return dt.timestamp() if dt is not None else None
