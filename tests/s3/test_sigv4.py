"""SigV4 against AWS's published examples (pure), and chunked uploads sent by hand to a real gateway."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import time
import zlib
import base64
from urllib.parse import urlparse

import pytest

from threefs.s3 import sigv4
from threefs.s3.errors import S3Error

# AWS's example "Signature Calculations for the Authorization Header: Transferring Payload in Multiple
# Chunks" (S3 API reference, sigv4-streaming)
EX_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
EX_DATE = "20130524T000000Z"
EX_SCOPE = "20130524/us-east-1/s3/aws4_request"
EX_SEED = "4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9"
EX_CHUNK_SIGS = ["ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648",
                 "0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497",
                 "b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9"]


def _example_headers() -> dict[str, list[str]]:
    h = {"host": "s3.amazonaws.com", "x-amz-date": EX_DATE, "x-amz-storage-class": "REDUCED_REDUNDANCY",
         "authorization": "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
         "SignedHeaders=content-encoding;content-length;host;x-amz-content-sha256;x-amz-date;"
         f"x-amz-decoded-content-length;x-amz-storage-class,Signature={EX_SEED}",
         "x-amz-content-sha256": sigv4.STREAMING_SIGNED, "content-encoding": "aws-chunked",
         "content-length": "66824", "x-amz-decoded-content-length": "66560"}
    return {k: [v] for k, v in h.items()}


def chunked_body(data_chunks: list[bytes], key: bytes, scope: str, amz_date: str, seed: str) -> bytes:
    """aws-chunked framing with chunk signatures, written from AWS's description."""
    out, prev = [], seed
    for chunk in data_chunks + [b""]:
        to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", amz_date, scope, prev,
                             hashlib.sha256(b"").hexdigest(), hashlib.sha256(chunk).hexdigest()])
        prev = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        out.append(f"{len(chunk):x};chunk-signature={prev}\r\n".encode() + chunk + b"\r\n")
    return b"".join(out)


def test_aws_streaming_example():
    auth = sigv4.verify("PUT", ["/examplebucket/chunkObject.txt"], "", _example_headers(),
                        lambda k: EX_SECRET, now=sigv4.parse_amz_date(EX_DATE))
    assert auth.seed_signature == EX_SEED and auth.payload_hash == sigv4.STREAMING_SIGNED
    body = chunked_body([b"a" * 65536, b"a" * 1024], auth.key, EX_SCOPE, EX_DATE, EX_SEED)
    assert len(body) == 66824
    for sig in EX_CHUNK_SIGS:
        assert f"chunk-signature={sig}".encode() in body
    dec = sigv4.ChunkDecoder(auth)
    got = b"".join(b"".join(dec.feed(body[i:i + 1000])) for i in range(0, len(body), 1000))
    dec.finish()
    assert got == b"a" * 66560
    tampered = body.replace(b"a" * 10, b"b" * 10, 1)
    with pytest.raises(S3Error) as e:
        sigv4.ChunkDecoder(auth).feed(tampered)
    assert e.value.code == "SignatureDoesNotMatch"


def test_aws_get_example_and_clock():
    """AWS's 'GET Object' header-auth example (range request)."""
    headers = {"host": ["examplebucket.s3.amazonaws.com"], "range": ["bytes=0-9"],
               "x-amz-content-sha256": [sigv4.EMPTY_SHA256], "x-amz-date": ["20130524T000000Z"],
               "authorization": ["AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/"
                                 "aws4_request,SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
                                 "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"]}
    now = sigv4.parse_amz_date(EX_DATE)
    assert sigv4.verify("GET", ["/test.txt"], "", headers, lambda k: EX_SECRET, now=now).access_key == \
        "AKIAIOSFODNN7EXAMPLE"
    with pytest.raises(S3Error) as e:
        sigv4.verify("GET", ["/test.txt"], "", headers, lambda k: EX_SECRET + "x", now=now)
    assert e.value.code == "SignatureDoesNotMatch"
    with pytest.raises(S3Error) as e:
        sigv4.verify("GET", ["/test.txt"], "", headers, lambda k: EX_SECRET, now=now + 3600)
    assert e.value.code == "RequestTimeTooSkewed"


def _sign_headers(method, url, headers, access, secret, payload_hash):
    """Header SigV4 signing of a hand-made request (host, x-amz-* and content-* headers signed)."""
    u = urlparse(url)
    amz_date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    date = amz_date[:8]
    headers = dict(headers, host=u.netloc, **{"x-amz-date": amz_date, "x-amz-content-sha256": payload_hash})
    names = sorted(k.lower() for k in headers)
    canon = "".join(f"{k}:{str(headers[k]).strip()}\n" for k in names)
    creq = "\n".join([method, u.path, "", canon, ";".join(names), payload_hash])
    scope = f"{date}/us-east-1/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(creq.encode()).hexdigest()])
    key = sigv4.signing_key(secret, date, "us-east-1", "s3")
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access}/{scope},SignedHeaders={';'.join(names)},"
                                f"Signature={sig}")
    return headers, key, scope, amz_date, sig


def _send(gateway, method, path, headers, body):
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_streaming_signed_put(gateway, s3, bucket, admin_key, rng):
    data = [rng.randbytes(64 << 10), rng.randbytes(100_000), rng.randbytes(7)]
    total = sum(map(len, data))
    path = f"/{bucket}/chunked/obj"
    base = {"content-encoding": "aws-chunked", "x-amz-decoded-content-length": str(total)}
    # the framing's length depends only on the chunk sizes, so it is known before signing
    framed_len = len(chunked_body(data, b"k", "s", "d", "0" * 64))
    headers, key, scope, amz_date, seed = _sign_headers("PUT", gateway.endpoint + path,
                                                        dict(base, **{"content-length": str(framed_len)}),
                                                        *admin_key, sigv4.STREAMING_SIGNED)
    body = chunked_body(data, key, scope, amz_date, seed)
    status, text = _send(gateway, "PUT", path, headers, body)
    assert status == 200, text
    got = s3.get_object(Bucket=bucket, Key="chunked/obj")
    assert got["Body"].read() == b"".join(data)
    assert got["ETag"] == f'"{hashlib.md5(b"".join(data)).hexdigest()}"'
    # one flipped byte in a chunk: refused, and nothing lands
    headers, key, scope, amz_date, seed = _sign_headers("PUT", gateway.endpoint + path + "2",
                                                        dict(base, **{"content-length": str(framed_len)}),
                                                        *admin_key, sigv4.STREAMING_SIGNED)
    body = bytearray(chunked_body(data, key, scope, amz_date, seed))
    body[-200] ^= 1
    status, text = _send(gateway, "PUT", path + "2", headers, bytes(body))
    assert status == 403 and b"SignatureDoesNotMatch" in text
    with pytest.raises(Exception):
        s3.head_object(Bucket=bucket, Key="chunked/obj2")


def test_unsigned_payload_with_trailer(gateway, s3, bucket, admin_key, rng):
    data = rng.randbytes(300_000)
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    for good in (True, False):
        trailer = crc if good else base64.b64encode(b"\0\0\0\0").decode()
        body = (f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n"
                + f"x-amz-checksum-crc32:{trailer}\r\n\r\n".encode())
        path = f"/{bucket}/trailer-{good}"
        headers, *_ = _sign_headers("PUT", gateway.endpoint + path, {
            "content-encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(data)),
            "x-amz-trailer": "x-amz-checksum-crc32", "content-length": str(len(body))},
            *admin_key, sigv4.STREAMING_UNSIGNED_TRAILER)
        status, text = _send(gateway, "PUT", path, headers, body)
        if good:
            assert status == 200, text
            assert s3.get_object(Bucket=bucket, Key=f"trailer-{good}")["Body"].read() == data
        else:
            assert status == 400 and b"BadDigest" in text


def test_payload_hash_and_content_md5_mismatch(gateway, s3, bucket, admin_key):
    path = f"/{bucket}/bad-hash"
    headers, *_ = _sign_headers("PUT", gateway.endpoint + path, {"content-length": "5"}, *admin_key,
                                hashlib.sha256(b"other").hexdigest())
    status, text = _send(gateway, "PUT", path, headers, b"hello")
    assert status == 400 and b"XAmzContentSHA256Mismatch" in text
    md5 = base64.b64encode(hashlib.md5(b"other").digest()).decode()
    headers, *_ = _sign_headers("PUT", gateway.endpoint + path, {"content-length": "5", "content-md5": md5},
                                *admin_key, hashlib.sha256(b"hello").hexdigest())
    status, text = _send(gateway, "PUT", path, headers, b"hello")
    assert status == 400 and b"BadDigest" in text
    with pytest.raises(Exception):
        s3.head_object(Bucket=bucket, Key="bad-hash")


def test_signed_trailer(gateway, s3, bucket, admin_key, rng):
    """STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER: signed chunks, then a checksum trailer and its
    signature (over `name:value\\n` lines, chained to the last chunk's signature)."""
    data = rng.randbytes(70_000)
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    path = f"/{bucket}/signed-trailer"

    def body_for(key, scope, amz_date, seed, trailer_value):
        out, prev = [], seed
        for chunk in (data, b""):
            to_sign = "\n".join(["AWS4-HMAC-SHA256-PAYLOAD", amz_date, scope, prev,
                                 hashlib.sha256(b"").hexdigest(), hashlib.sha256(chunk).hexdigest()])
            prev = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            out.append(f"{len(chunk):x};chunk-signature={prev}\r\n".encode() + chunk + (b"\r\n" if chunk else b""))
        trailer = f"x-amz-checksum-crc32:{trailer_value}\n"
        to_sign = "\n".join(["AWS4-HMAC-SHA256-TRAILER", amz_date, scope, prev,
                             hashlib.sha256(trailer.encode()).hexdigest()])
        sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        out.append(f"x-amz-checksum-crc32:{trailer_value}\r\nx-amz-trailer-signature:{sig}\r\n\r\n".encode())
        return b"".join(out)

    length = len(body_for(b"k", "s", "d", "0" * 64, crc))
    for good in (True, False):
        headers, key, scope, amz_date, seed = _sign_headers("PUT", gateway.endpoint + path, {
            "content-encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(data)),
            "x-amz-trailer": "x-amz-checksum-crc32", "content-length": str(length)},
            *admin_key, sigv4.STREAMING_SIGNED_TRAILER)
        body = body_for(key, scope, amz_date, seed, crc)
        if not good:  # the trailer changed after signing
            body = body.replace(crc.encode(), base64.b64encode(b"\0\0\0\0"), 1)
        status, text = _send(gateway, "PUT", path, headers, body)
        if good:
            assert status == 200, text
            assert s3.get_object(Bucket=bucket, Key="signed-trailer")["Body"].read() == data
        else:
            assert status in (400, 403) and (b"SignatureDoesNotMatch" in text or b"BadDigest" in text), text


def test_expect_100_continue(gateway, s3, bucket, admin_key):
    """A refused PUT is answered before its body is sent; an accepted one gets `100 Continue`."""
    import socket

    def start(path: str, length: int) -> socket.socket:
        headers, *_ = _sign_headers("PUT", gateway.endpoint + path, {"content-length": str(length),
                                    "expect": "100-continue"}, *admin_key, sigv4.UNSIGNED)
        sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=30)
        head = f"PUT {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        sock.sendall(head.encode())
        return sock

    def read_head(sock) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            piece = sock.recv(65536)
            assert piece, "connection closed"
            data += piece
        return data

    sock = start("/no-such-bucket-for-100/k", 1 << 30)  # a GiB that is never sent
    try:
        assert read_head(sock).startswith(b"HTTP/1.1 404")
    finally:
        sock.close()
    sock = start(f"/{bucket}/continued", 5)
    try:
        assert read_head(sock).startswith(b"HTTP/1.1 100")
        sock.sendall(b"hello")
        assert read_head(sock).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()
    assert s3.get_object(Bucket=bucket, Key="continued")["Body"].read() == b"hello"
