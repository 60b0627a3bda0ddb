"""Both of botocore's SigV4 signers against the gateway.

botocore signs with the AWS CRT's SigV4 (botocore.crt.auth) when the `awscrt` package is importable, else
with its own Python signers (botocore.auth). threefs depends on awscrt (its CRC32C), so boto3 in this
environment, and in every other test here, uses the CRT's; users without awscrt get the Python ones. This
file runs the same requests with the Python signers forced, and checks that each signer did sign."""

from __future__ import annotations

import hashlib
import urllib.request

import botocore.auth
import pytest

from tests.s3.conftest import client_for

PYTHON_SIGNERS = {"v4": botocore.auth.SigV4Auth, "v4-query": botocore.auth.SigV4QueryAuth,
                  "s3v4": botocore.auth.S3SigV4Auth, "s3v4-query": botocore.auth.S3SigV4QueryAuth}


def _crt_signers() -> dict:
    try:
        from botocore.crt.auth import CRT_AUTH_TYPE_MAPS
    except ImportError:
        return {}
    return {k: v for k, v in CRT_AUTH_TYPE_MAPS.items() if k in PYTHON_SIGNERS}


@pytest.fixture(params=["python", "crt"])
def signer(request, monkeypatch):
    """Forces one kind of signer and counts its signatures ({"header": n, "query": n})."""
    maps = PYTHON_SIGNERS if request.param == "python" else _crt_signers()
    if not maps:
        pytest.skip("botocore's CRT signers need awscrt, which is not installed")
    counts = {"header": 0, "query": 0}
    for name, cls in maps.items():
        monkeypatch.setitem(botocore.auth.AUTH_TYPE_MAPS, name, cls)
    for name in ("s3v4", "s3v4-query"):
        cls, kind = maps[name], "query" if name.endswith("query") else "header"
        original = cls.add_auth

        def counted(self, req, _original=original, _kind=kind):
            counts[_kind] += 1
            return _original(self, req)

        monkeypatch.setattr(cls, "add_auth", counted)
    return counts


def test_the_crt_signers_are_botocores_default_here():
    assert _crt_signers(), "threefs depends on awscrt: botocore's CRT signers should be importable"
    assert botocore.auth.AUTH_TYPE_MAPS["s3v4"] is _crt_signers()["s3v4"]


def test_requests_signed_either_way(gateway, admin_key, signer):
    s3 = client_for(gateway.endpoint, admin_key)  # (a new client: it looks its signer up when signing)
    name = f"signers-{id(signer)}"
    s3.create_bucket(Bucket=name)
    try:
        body = b"signed either way " * 1000
        s3.put_object(Bucket=name, Key="dir/k", Body=body, Metadata={"m": "1"})
        assert s3.get_object(Bucket=name, Key="dir/k")["Body"].read() == body
        got = s3.get_object(Bucket=name, Key="dir/k", Range="bytes=7-16")["Body"].read()
        assert got == body[7:17]
        assert [o["Key"] for o in s3.list_objects_v2(Bucket=name, Prefix="dir/")["Contents"]] == ["dir/k"]
        up = s3.create_multipart_upload(Bucket=name, Key="multi")["UploadId"]
        parts = [b"a" * (5 << 20), b"b" * 1000]
        etags = [s3.upload_part(Bucket=name, Key="multi", UploadId=up, PartNumber=i + 1, Body=p)["ETag"]
                 for i, p in enumerate(parts)]
        s3.complete_multipart_upload(Bucket=name, Key="multi", UploadId=up, MultipartUpload={
            "Parts": [{"ETag": e, "PartNumber": i + 1} for i, e in enumerate(etags)]})
        assert hashlib.md5(s3.get_object(Bucket=name, Key="multi")["Body"].read()).digest() == \
            hashlib.md5(b"".join(parts)).digest()
        s3.copy_object(Bucket=name, Key="copy", CopySource={"Bucket": name, "Key": "dir/k"})
        # (boto3 presigns with SigV2's query form in us-east-1 unless told s3v4)
        v4 = client_for(gateway.endpoint, admin_key, signature_version="s3v4")
        url = v4.generate_presigned_url("get_object", Params={"Bucket": name, "Key": "copy"}, ExpiresIn=300)
        assert "X-Amz-Signature=" in url
        with urllib.request.urlopen(url, timeout=30) as rsp:
            assert rsp.read() == body
        s3.delete_objects(Bucket=name, Delete={"Objects": [{"Key": k} for k in ("dir/k", "multi", "copy")]})
    finally:
        s3.delete_bucket(Bucket=name)
    assert signer["header"] >= 10 and signer["query"] == 1, signer
