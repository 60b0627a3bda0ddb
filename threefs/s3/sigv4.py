"""AWS Signature Version 4 for S3: header and query (presigned) auth, and aws-chunked bodies.

Pure code: the request's parts go in, an `Auth` (who signed, and how the body must be checked) or an
S3Error comes out. The chunk decoder is sans-IO (bytes in, payload pieces out).
"""

from __future__ import annotations

import base64
import calendar
import hashlib
import hmac
import time
import zlib
from typing import Callable
from urllib.parse import quote, unquote

from threefs.s3.errors import S3Error

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED = "UNSIGNED-PAYLOAD"
STREAMING_SIGNED = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD"
STREAMING_SIGNED_TRAILER = "STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER"
STREAMING_UNSIGNED_TRAILER = "STREAMING-UNSIGNED-PAYLOAD-TRAILER"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
CLOCK_SKEW_S_MAX = 15 * 60
PRESIGN_EXPIRES_S_MAX = 7 * 24 * 3600
CHUNK_HEADER_BYTES_MAX = 4096
CHUNK_BYTES_MAX = 64 << 20


def uri_encode(s: str, slash: bool = True) -> str:
    return quote(s, safe="-_.~" + ("/" if not slash else ""))


def canonical_query(raw_query: str, drop: str = "") -> str:
    pairs = []
    for part in raw_query.split("&") if raw_query else []:
        k, _, v = part.partition("=")
        k, v = unquote(k.replace("+", "%20")), unquote(v.replace("+", "%20"))
        if k == drop:
            continue
        pairs.append((uri_encode(k), uri_encode(v)))
    pairs.sort()
    return "&".join(f"{k}={v}" for k, v in pairs)


def signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    k = hmac.new(("AWS4" + secret).encode(), date.encode(), hashlib.sha256).digest()
    for part in (region, service, "aws4_request"):
        k = hmac.new(k, part.encode(), hashlib.sha256).digest()
    return k


def _hmac_hex(key: bytes, text: str) -> str:
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def parse_amz_date(text: str) -> int:
    try:
        return calendar.timegm(time.strptime(text, "%Y%m%dT%H%M%SZ"))
    except ValueError:
        raise S3Error("AccessDenied", f"X-Amz-Date {text!r} is not of the form YYYYMMDDTHHMMSSZ") from None


class Auth:
    """A verified request: the access key and what remains to check on the body."""

    def __init__(self, access_key: str, payload_hash: str, key: bytes = b"", scope: str = "",
                 amz_date: str = "", seed_signature: str = ""):
        self.access_key = access_key
        self.payload_hash = payload_hash  # hex sha256, UNSIGNED-PAYLOAD or a STREAMING-* mode
        self.key, self.scope, self.amz_date, self.seed_signature = key, scope, amz_date, seed_signature

    @property
    def streaming(self) -> bool:
        return self.payload_hash.startswith("STREAMING-")


def _parse_credential(cred: str) -> tuple[str, str, str, str]:
    parts = cred.split("/")
    if len(parts) != 5 or parts[4] != "aws4_request":
        raise S3Error("AuthorizationHeaderMalformed", f"credential {cred!r} is not "
                      "ACCESS_KEY/YYYYMMDD/REGION/s3/aws4_request")
    return parts[0], parts[1], parts[2], parts[3]


def _canonical_headers(headers: dict[str, list[str]], signed: list[str]) -> str:
    lines = []
    for name in signed:
        values = headers.get(name)
        if values is None:
            raise S3Error("AccessDenied", f"signed header {name!r} is not in the request")
        lines.append(name + ":" + ",".join(" ".join(v.split()) for v in values) + "\n")
    return "".join(lines)


def verify(method: str, paths: list[str], raw_query: str, headers: dict[str, list[str]],
           secret_of: Callable[[str], str], now: float | None = None) -> Auth | None:
    """Verify a request's SigV4 signature (header or query). `paths` are candidate canonical URIs
    (the raw path as sent, then re-encoded); `headers` maps lower-case names to their values;
    `secret_of(access_key)` raises InvalidAccessKeyId for an unknown key. None: anonymous."""
    now = time.time() if now is None else now
    authz = headers.get("authorization", [""])[0]
    query = dict(p.partition("=")[::2] for p in raw_query.split("&")) if raw_query else {}
    if authz and not authz.startswith("AWS "):
        return _verify_header(method, paths, raw_query, headers, authz, secret_of, now)
    if "X-Amz-Signature" in query:
        return _verify_query(method, paths, raw_query, headers, query, secret_of, now)
    return None


def _verify_header(method, paths, raw_query, headers, authz, secret_of, now) -> Auth:
    if not authz.startswith(ALGORITHM + " "):
        raise S3Error("AuthorizationHeaderMalformed", f"unsupported authorization {authz.split(' ')[0]!r}")
    fields = {}
    for part in authz[len(ALGORITHM) + 1:].split(","):
        k, _, v = part.strip().partition("=")
        fields[k] = v
    if not {"Credential", "SignedHeaders", "Signature"} <= fields.keys():
        raise S3Error("AuthorizationHeaderMalformed", "the Authorization header needs Credential, "
                      "SignedHeaders and Signature")
    access_key, date, region, service = _parse_credential(fields["Credential"])
    amz_date = headers.get("x-amz-date", [""])[0]
    if not amz_date:
        raise S3Error("AccessDenied", "AWS authentication requires a valid Date or x-amz-date header")
    if abs(parse_amz_date(amz_date) - now) > CLOCK_SKEW_S_MAX:
        raise S3Error("RequestTimeTooSkewed", "the difference between the request time and the "
                      "server's time is too large", RequestTime=amz_date)
    if amz_date[:8] != date:
        raise S3Error("SignatureDoesNotMatch", "the credential's date is not the request's date")
    payload = headers.get("x-amz-content-sha256", [""])[0]
    if not payload:
        raise S3Error("InvalidRequest", "missing required header for this request: x-amz-content-sha256")
    secret = secret_of(access_key)
    key = signing_key(secret, date, region, service)
    scope = f"{date}/{region}/{service}/aws4_request"
    signed = fields["SignedHeaders"].split(";")
    _check_signature(method, paths, canonical_query(raw_query), _canonical_headers(headers, signed),
                     fields["SignedHeaders"], payload, amz_date, scope, key, fields["Signature"], access_key)
    return Auth(access_key, payload, key, scope, amz_date, fields["Signature"])


def _verify_query(method, paths, raw_query, headers, query, secret_of, now) -> Auth:
    q = {k: unquote(v) for k, v in query.items()}
    if q.get("X-Amz-Algorithm") != ALGORITHM:
        raise S3Error("AuthorizationQueryParametersError", "X-Amz-Algorithm must be AWS4-HMAC-SHA256")
    for name in ("X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-SignedHeaders"):
        if name not in q:
            raise S3Error("AuthorizationQueryParametersError", f"presigned URL lacks {name}")
    access_key, date, region, service = _parse_credential(q["X-Amz-Credential"])
    try:
        expires = int(q["X-Amz-Expires"])
    except ValueError:
        raise S3Error("AuthorizationQueryParametersError", "X-Amz-Expires must be a number") from None
    if not 0 <= expires <= PRESIGN_EXPIRES_S_MAX:
        raise S3Error("AccessDenied", "X-Amz-Expires must be less than a week (in seconds), that is, the given "
                      "X-Amz-Expires must be less than 604800 seconds")
    signed_at = parse_amz_date(q["X-Amz-Date"])
    if now > signed_at + expires:
        raise S3Error("AccessDenied", "Request has expired", Expires=time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(signed_at + expires)))
    if signed_at - now > CLOCK_SKEW_S_MAX:
        raise S3Error("AccessDenied", "Request is not valid yet")
    secret = secret_of(access_key)
    key = signing_key(secret, date, region, service)
    scope = f"{date}/{region}/{service}/aws4_request"
    payload = q.get("X-Amz-Content-Sha256", UNSIGNED)
    _check_signature(method, paths, canonical_query(raw_query, drop="X-Amz-Signature"),
                     _canonical_headers(headers, q["X-Amz-SignedHeaders"].split(";")),
                     q["X-Amz-SignedHeaders"], payload, q["X-Amz-Date"], scope, key, q["X-Amz-Signature"],
                     access_key)
    return Auth(access_key, payload, key, scope, q["X-Amz-Date"], q["X-Amz-Signature"])


def _check_signature(method, paths, cquery, cheaders, signed, payload, amz_date, scope, key, signature,
                     access_key) -> None:
    for path in dict.fromkeys(paths):
        creq = "\n".join((method, path, cquery, cheaders, signed, payload))
        to_sign = "\n".join((ALGORITHM, amz_date, scope, hashlib.sha256(creq.encode()).hexdigest()))
        if hmac.compare_digest(_hmac_hex(key, to_sign), signature):
            return
    raise S3Error("SignatureDoesNotMatch", "the request signature we calculated does not match the "
                  "signature you provided; check your key and signing method", AWSAccessKeyId=access_key)


# -- aws-chunked bodies ------------------------------------------------------------------------------
class ChunkDecoder:
    """Decodes an aws-chunked body: `hex-size[;chunk-signature=SIG]\\r\\n DATA \\r\\n ... 0...\\r\\n`
    then optional trailer lines and `\\r\\n`. Checks each chunk's signature (signed modes) and the
    trailing checksum. feed() returns the payload pieces found so far; finish() checks the end."""

    def __init__(self, auth: Auth):
        self.auth = auth
        self.signed = auth.payload_hash in (STREAMING_SIGNED, STREAMING_SIGNED_TRAILER)
        self.prev_signature = auth.seed_signature
        self.buf = bytearray()
        self.state = "header"  # header -> data -> crlf -> header ... -> trailer -> done
        self.need = 0
        self.chunk_sig = ""
        self.chunk_hash = None
        self.trailers: dict[str, str] = {}
        self.checksum = None  # (algorithm name, running state) from x-amz-trailer

    def expect_trailer(self, name: str) -> None:
        name = name.strip().lower()
        if name in ("x-amz-checksum-crc32", "x-amz-checksum-crc32c", "x-amz-checksum-sha1",
                    "x-amz-checksum-sha256"):
            self.checksum = Checksum(name)

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        while True:
            if self.state == "header":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    if len(self.buf) > CHUNK_HEADER_BYTES_MAX:
                        raise S3Error("IncompleteBody", "malformed aws-chunked header")
                    return out
                self._header(bytes(self.buf[:end]).decode("latin-1"))
                del self.buf[:end + 2]
            elif self.state == "data":
                take = min(self.need, len(self.buf))
                if take == 0:
                    return out
                piece = bytes(self.buf[:take])
                del self.buf[:take]
                self.need -= take
                if self.chunk_hash is not None:
                    self.chunk_hash.update(piece)
                if self.checksum is not None:
                    self.checksum.update(piece)
                out.append(piece)
                if self.need == 0:
                    self._end_chunk()
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(self.buf) < 2:
                    return out
                if self.buf[:2] != b"\r\n":
                    raise S3Error("IncompleteBody", "aws-chunked data is not followed by CRLF")
                del self.buf[:2]
                self.state = "header"
            elif self.state == "trailer":
                end = self.buf.find(b"\r\n")
                if end < 0:
                    if len(self.buf) > CHUNK_HEADER_BYTES_MAX:
                        raise S3Error("IncompleteBody", "malformed aws-chunked trailer")
                    return out
                line = bytes(self.buf[:end]).decode("latin-1")
                del self.buf[:end + 2]
                if line == "":
                    self.state = "done"
                else:
                    k, _, v = line.partition(":")
                    self.trailers[k.strip().lower()] = v.strip()
            else:
                if self.buf.strip():
                    raise S3Error("IncompleteBody", "data after the end of an aws-chunked body")
                self.buf.clear()
                return out

    def _header(self, line: str) -> None:
        size_text, _, ext = line.partition(";")
        try:
            size = int(size_text, 16)
        except ValueError:
            raise S3Error("IncompleteBody", f"malformed aws-chunked size {size_text[:20]!r}") from None
        if size > CHUNK_BYTES_MAX:
            raise S3Error("InvalidChunkSizeError", f"aws-chunked chunk of {size} bytes is too large")
        if self.signed:
            k, _, v = ext.partition("=")
            if k.strip() != "chunk-signature" or not v:
                raise S3Error("SignatureDoesNotMatch", "aws-chunked chunk lacks its chunk-signature")
            self.chunk_sig = v.strip()
            self.chunk_hash = hashlib.sha256()
        self.need = size
        if size == 0:
            self._end_chunk()
            self.state = "trailer"
        else:
            self.state = "data"

    def _end_chunk(self) -> None:
        if not self.signed:
            return
        to_sign = "\n".join(("AWS4-HMAC-SHA256-PAYLOAD", self.auth.amz_date, self.auth.scope,
                             self.prev_signature, EMPTY_SHA256, self.chunk_hash.hexdigest()))
        if not hmac.compare_digest(_hmac_hex(self.auth.key, to_sign), self.chunk_sig):
            raise S3Error("SignatureDoesNotMatch", "an aws-chunked chunk's signature does not match")
        self.prev_signature = self.chunk_sig

    def finish(self) -> dict[str, str]:
        """After the body: check that it ended properly and the trailing checksum; the trailers."""
        if self.state not in ("done", "trailer") or (self.state == "trailer" and self.buf):
            raise S3Error("IncompleteBody", "the aws-chunked body ended early")
        if self.auth.payload_hash == STREAMING_SIGNED_TRAILER:
            self._check_trailer_signature()
        if self.checksum is not None:
            sent = self.trailers.get(self.checksum.name)
            if sent is not None and sent != self.checksum.value():
                raise S3Error("BadDigest", f"the {self.checksum.name} you specified did not match "
                              "what we received")
        return self.trailers


    def _check_trailer_signature(self) -> None:
        sent = self.trailers.get("x-amz-trailer-signature")
        if sent is None:
            raise S3Error("SignatureDoesNotMatch", "the signed aws-chunked trailer lacks x-amz-trailer-signature")
        text = "".join(f"{k}:{v}\n" for k, v in self.trailers.items() if k != "x-amz-trailer-signature")
        to_sign = "\n".join(("AWS4-HMAC-SHA256-TRAILER", self.auth.amz_date, self.auth.scope, self.prev_signature,
                             hashlib.sha256(text.encode()).hexdigest()))
        if not hmac.compare_digest(_hmac_hex(self.auth.key, to_sign), sent):
            raise S3Error("SignatureDoesNotMatch", "the aws-chunked trailer's signature does not match")


class Checksum:
    """The x-amz-checksum-* algorithms S3 clients send (base64 of the big-endian digest)."""

    def __init__(self, name: str):
        self.name = name
        self.algorithm = name.rsplit("-", 1)[1]
        self.crc = 0
        self.hash = {"sha1": hashlib.sha1, "sha256": hashlib.sha256}.get(self.algorithm, lambda: None)()

    def update(self, data) -> None:
        if self.algorithm == "crc32":
            self.crc = zlib.crc32(data, self.crc)
        elif self.algorithm == "crc32c":
            from threefs.common import crc32c

            self.crc = crc32c.crc32c(data, self.crc)
        else:
            self.hash.update(data)

    def value(self) -> str:
        digest = self.hash.digest() if self.hash is not None else self.crc.to_bytes(4, "big")
        return base64.b64encode(digest).decode()


# -- signature version 2 (boto3 still presigns with it by default) --------------------------------------
V2_SUBRESOURCES = frozenset((
    "acl", "delete", "lifecycle", "location", "logging", "notification", "partNumber", "policy",
    "requestPayment", "torrent", "uploadId", "uploads", "versionId", "versioning", "versions", "website",
    "cors", "tagging", "restore", "response-cache-control", "response-content-disposition",
    "response-content-encoding", "response-content-language", "response-content-type", "response-expires"))


def _v2_string_to_sign(method: str, path: str, query: dict[str, str], headers: dict[str, list[str]],
                       date: str) -> str:
    amz = sorted((k, ",".join(v.strip() for v in vs)) for k, vs in headers.items()
                 if k.startswith("x-amz-"))
    sub = sorted((k, v) for k, v in query.items() if k in V2_SUBRESOURCES)
    resource = path + ("?" + "&".join(f"{k}={v}" if v != "" else k for k, v in sub) if sub else "")
    return "\n".join([method, headers.get("content-md5", [""])[0], headers.get("content-type", [""])[0], date]
                     + [f"{k}:{v}" for k, v in amz] + [resource])


def verify_v2(method: str, raw_path: str, query: dict[str, str], headers: dict[str, list[str]],
              secret_of: Callable[[str], str], now: float | None = None) -> Auth | None:
    """SigV2: `Authorization: AWS KEY:SIG`, or presigned `?AWSAccessKeyId&Expires&Signature`."""
    now = time.time() if now is None else now
    authz = headers.get("authorization", [""])[0]
    path = unquote(raw_path)
    if authz.startswith("AWS "):
        access_key, _, signature = authz[4:].partition(":")
        date = "" if "x-amz-date" in headers else headers.get("date", [""])[0]
        sent_at = headers.get("x-amz-date", headers.get("date", [""]))[0]
        import email.utils

        try:
            t = email.utils.parsedate_to_datetime(sent_at).timestamp()
        except (TypeError, ValueError):
            raise S3Error("AccessDenied", "AWS authentication requires a valid Date or x-amz-date header") from None
        if abs(t - now) > CLOCK_SKEW_S_MAX:
            raise S3Error("RequestTimeTooSkewed", "the difference between the request time and the server's "
                          "time is too large")
    elif "Signature" in query and "AWSAccessKeyId" in query:
        access_key, signature, date = query["AWSAccessKeyId"], query["Signature"], query.get("Expires", "")
        if not date.isdigit():
            raise S3Error("AccessDenied", "a presigned URL needs Expires")
        if now > int(date):
            raise S3Error("AccessDenied", "Request has expired")
    else:
        return None
    secret = secret_of(access_key)
    # candidates: as sent, re-encoded, and a bucket's path with the trailing "/" botocore signs
    candidates = [quote(path, safe="/~"), raw_path]
    if path.count("/") == 1 and len(path) > 1:
        candidates.append(path + "/")
    for candidate in dict.fromkeys(candidates):
        to_sign = _v2_string_to_sign(method, candidate, query, headers, date)
        want = base64.b64encode(hmac.new(secret.encode(), to_sign.encode("utf-8", "surrogateescape"),
                                         hashlib.sha1).digest()).decode()
        if hmac.compare_digest(want, signature):
            break
    else:
        raise S3Error("SignatureDoesNotMatch", "the request signature we calculated does not match the "
                      "signature you provided; check your key and signing method", AWSAccessKeyId=access_key)
    return Auth(access_key, UNSIGNED)
