"""boto3 against a real gateway process on a real cluster: every operation, S3's error codes."""

from __future__ import annotations

import datetime
import hashlib
import io

import pytest
from botocore.exceptions import ClientError

from tests.s3.conftest import error_code

KEYS_ODD = ["a", "a/", "a/b", "a/b/", "a//b", "./x", "../y", "x/./y", "%e", "%o", "%%", "sp ace+plus&amp",
            "ü/日本語/ключ", "t" * 250, "u" * 200 + "/" + "v" * 300, "a-b", "a.b", "a0"]


def test_buckets(s3, fs):
    s3.create_bucket(Bucket="bk-life")
    try:
        assert "bk-life" in [b["Name"] for b in s3.list_buckets()["Buckets"]]
        s3.head_bucket(Bucket="bk-life")
        assert fs.stat("/bk-life").type == 2  # a bucket is a directory
        with pytest.raises(ClientError) as e:
            s3.create_bucket(Bucket="bk-life")
        assert error_code(e) == "BucketAlreadyOwnedByYou"
        s3.put_object(Bucket="bk-life", Key="k", Body=b"1")
        with pytest.raises(ClientError) as e:
            s3.delete_bucket(Bucket="bk-life")
        assert error_code(e) == "BucketNotEmpty"
        s3.delete_object(Bucket="bk-life", Key="k")
        assert s3.get_bucket_location(Bucket="bk-life")["LocationConstraint"] is None
    finally:
        s3.delete_bucket(Bucket="bk-life")
    with pytest.raises(ClientError) as e:
        s3.head_bucket(Bucket="bk-life")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    for bad in ("Upper", "ab", "a_b", "-ab"):
        with pytest.raises(ClientError) as e:
            s3.create_bucket(Bucket=bad)
        assert error_code(e) == "InvalidBucketName"
    with pytest.raises(ClientError) as e:
        s3.list_objects_v2(Bucket="no-such-bucket-here")
    assert error_code(e) == "NoSuchBucket"


def test_put_get_head_delete_and_metadata(s3, bucket, fs):
    body = b"hello world" * 1000
    rsp = s3.put_object(Bucket=bucket, Key="dir/obj.txt", Body=body, ContentType="text/plain",
                        Metadata={"color": "blue", "n": "1"}, CacheControl="max-age=5",
                        ContentDisposition="attachment")
    assert rsp["ETag"] == f'"{hashlib.md5(body).hexdigest()}"'
    got = s3.get_object(Bucket=bucket, Key="dir/obj.txt")
    assert got["Body"].read() == body
    assert got["ContentType"] == "text/plain" and got["Metadata"] == {"color": "blue", "n": "1"}
    assert got["CacheControl"] == "max-age=5" and got["ContentDisposition"] == "attachment"
    assert got["ETag"] == rsp["ETag"] and got["ContentLength"] == len(body)
    head = s3.head_object(Bucket=bucket, Key="dir/obj.txt")
    assert head["ContentLength"] == len(body) and head["ETag"] == rsp["ETag"]
    assert fs.read_bytes(f"/{bucket}/dir/obj.txt") == body  # an object is a plain file
    s3.put_object(Bucket=bucket, Key="empty", Body=b"")
    assert s3.get_object(Bucket=bucket, Key="empty")["Body"].read() == b""
    assert s3.head_object(Bucket=bucket, Key="empty")["ETag"] == f'"{hashlib.md5(b"").hexdigest()}"'
    s3.delete_object(Bucket=bucket, Key="dir/obj.txt")
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="dir/obj.txt")
    assert error_code(e) == "NoSuchKey"
    with pytest.raises(ClientError) as e:
        s3.head_object(Bucket=bucket, Key="dir/obj.txt")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert not fs.exists(f"/{bucket}/dir")  # the emptied directory went with its last object
    s3.delete_object(Bucket=bucket, Key="never-existed")  # S3: deleting nothing succeeds


def test_odd_keys_round_trip_and_list_in_order(s3, bucket):
    for i, key in enumerate(KEYS_ODD):
        s3.put_object(Bucket=bucket, Key=key, Body=f"body {i}".encode())
    for i, key in enumerate(KEYS_ODD):
        assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == f"body {i}".encode(), key
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert listed == sorted(KEYS_ODD, key=lambda k: k.encode())
    # replace `a` while `a/...` exists, then remove the prefix: `a` stays readable throughout
    s3.put_object(Bucket=bucket, Key="a", Body=b"new a")
    for key in [k for k in KEYS_ODD if k.startswith("a/") or k.startswith("a//")]:
        s3.delete_object(Bucket=bucket, Key=key)
    assert s3.get_object(Bucket=bucket, Key="a")["Body"].read() == b"new a"
    listed = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert listed.count("a") == 1


def test_listing_prefix_delimiter_pagination(s3, bucket):
    keys = sorted([f"logs/2024/{m:02d}/{d:02d}.log" for m in (1, 2, 3) for d in range(1, 6)]
                  + ["logs/readme", "logs-other", "top", "logs/2024/x"])
    for k in keys:
        s3.put_object(Bucket=bucket, Key=k, Body=k.encode())
    r = s3.list_objects_v2(Bucket=bucket, Prefix="logs/", Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["logs/2024/"]
    assert [o["Key"] for o in r["Contents"]] == ["logs/readme"]
    r = s3.list_objects_v2(Bucket=bucket, Prefix="logs/2024/", Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["logs/2024/01/", "logs/2024/02/", "logs/2024/03/"]
    assert r["KeyCount"] == 4
    r = s3.list_objects_v2(Bucket=bucket, Prefix="logs/2024/0")
    assert len(r["Contents"]) == 15
    # pages of 4 with continuation tokens give every key once, in order
    got, token = [], None
    while True:
        kw = {"ContinuationToken": token} if token else {}
        r = s3.list_objects_v2(Bucket=bucket, MaxKeys=4, **kw)
        got += [o["Key"] for o in r.get("Contents", [])]
        assert len(r.get("Contents", [])) <= 4
        if not r["IsTruncated"]:
            break
        token = r["NextContinuationToken"]
    assert got == keys
    r = s3.list_objects_v2(Bucket=bucket, StartAfter="logs/2024/03/05.log")
    assert [o["Key"] for o in r["Contents"]] == [k for k in keys if k > "logs/2024/03/05.log"]
    # delimiter pages: a common prefix counts once across pages
    seen, token = [], None
    while True:
        kw = {"ContinuationToken": token} if token else {}
        r = s3.list_objects_v2(Bucket=bucket, Delimiter="/", Prefix="logs/2024/", MaxKeys=1, **kw)
        seen += [p["Prefix"] for p in r.get("CommonPrefixes", [])] + [o["Key"] for o in r.get("Contents", [])]
        if not r["IsTruncated"]:
            break
        token = r["NextContinuationToken"]
    assert seen == ["logs/2024/01/", "logs/2024/02/", "logs/2024/03/", "logs/2024/x"]
    # v1 with markers; the paginator follows NextMarker
    pages = s3.get_paginator("list_objects").paginate(Bucket=bucket, PaginationConfig={"PageSize": 5})
    assert [o["Key"] for p in pages for o in p["Contents"]] == keys
    r = s3.list_objects(Bucket=bucket, Prefix="logs/", Delimiter="/", Marker="logs/2024/")
    assert [o["Key"] for o in r["Contents"]] == ["logs/readme"]
    assert s3.list_objects_v2(Bucket=bucket, Prefix="nothing/")["KeyCount"] == 0
    r = s3.list_objects_v2(Bucket=bucket, Delimiter="-")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["logs-"]


def test_ranges(s3, bucket):
    body = bytes(range(256)) * 100
    s3.put_object(Bucket=bucket, Key="r", Body=body)
    for rng, want in (("bytes=0-0", body[:1]), ("bytes=10-19", body[10:20]), ("bytes=25000-", body[25000:]),
                      ("bytes=-7", body[-7:]), ("bytes=25590-99999", body[25590:])):
        got = s3.get_object(Bucket=bucket, Key="r", Range=rng)
        assert got["Body"].read() == want, rng
        assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert got["ContentRange"].endswith(f"/{len(body)}")
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="r", Range="bytes=25600-")
    assert error_code(e) == "InvalidRange"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 416


def test_conditional_requests(s3, bucket):
    etag = s3.put_object(Bucket=bucket, Key="c", Body=b"v1")["ETag"]
    mtime = s3.head_object(Bucket=bucket, Key="c")["LastModified"]
    assert s3.get_object(Bucket=bucket, Key="c", IfMatch=etag)["Body"].read() == b"v1"
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="c", IfMatch='"0123"')
    assert error_code(e) == "PreconditionFailed"
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="c", IfNoneMatch=etag)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 304
    later = mtime + datetime.timedelta(seconds=10)
    earlier = mtime - datetime.timedelta(seconds=10)
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="c", IfModifiedSince=later)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 304
    assert s3.get_object(Bucket=bucket, Key="c", IfModifiedSince=earlier)["Body"].read() == b"v1"
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="c", IfUnmodifiedSince=earlier)
    assert error_code(e) == "PreconditionFailed"
    assert s3.get_object(Bucket=bucket, Key="c", IfUnmodifiedSince=later)["Body"].read() == b"v1"
    # conditional writes: If-None-Match: * creates only
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="c", Body=b"v2", IfNoneMatch="*")
    assert error_code(e) == "PreconditionFailed"
    s3.put_object(Bucket=bucket, Key="c-new", Body=b"n", IfNoneMatch="*")
    assert s3.get_object(Bucket=bucket, Key="c")["Body"].read() == b"v1"


def test_copy_object(s3, bucket):
    s3.put_object(Bucket=bucket, Key="src", Body=b"source" * 1000, ContentType="text/x", Metadata={"a": "1"})
    r = s3.copy_object(Bucket=bucket, Key="dst/copy", CopySource={"Bucket": bucket, "Key": "src"})
    assert r["CopyObjectResult"]["ETag"] == s3.head_object(Bucket=bucket, Key="src")["ETag"]
    got = s3.get_object(Bucket=bucket, Key="dst/copy")
    assert got["Body"].read() == b"source" * 1000 and got["Metadata"] == {"a": "1"} and got["ContentType"] == "text/x"
    s3.copy_object(Bucket=bucket, Key="dst/replaced", CopySource=f"{bucket}/src", MetadataDirective="REPLACE",
                   Metadata={"b": "2"}, ContentType="text/y")
    got = s3.head_object(Bucket=bucket, Key="dst/replaced")
    assert got["Metadata"] == {"b": "2"} and got["ContentType"] == "text/y"
    with pytest.raises(ClientError) as e:
        s3.copy_object(Bucket=bucket, Key="src", CopySource=f"{bucket}/src")
    assert error_code(e) == "InvalidRequest"
    s3.copy_object(Bucket=bucket, Key="src", CopySource=f"{bucket}/src", MetadataDirective="REPLACE",
                   Metadata={"c": "3"})  # in place: a metadata update
    got = s3.get_object(Bucket=bucket, Key="src")
    assert got["Metadata"] == {"c": "3"} and got["Body"].read() == b"source" * 1000
    with pytest.raises(ClientError) as e:
        s3.copy_object(Bucket=bucket, Key="x", CopySource=f"{bucket}/missing")
    assert error_code(e) == "NoSuchKey"
    with pytest.raises(ClientError) as e:
        s3.copy_object(Bucket=bucket, Key="x", CopySource=f"{bucket}/src", CopySourceIfMatch='"nope"')
    assert error_code(e) == "PreconditionFailed"


def test_delete_objects(s3, bucket):
    for i in range(20):
        s3.put_object(Bucket=bucket, Key=f"d/{i}", Body=b"x")
    r = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"d/{i}"} for i in range(15)]
                                                 + [{"Key": "not-there"}]})
    assert len(r["Deleted"]) == 16 and not r.get("Errors")
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == sorted(f"d/{i}" for i in range(15, 20))
    r = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "d/15"}], "Quiet": True})
    assert not r.get("Deleted")


def test_multipart_upload(s3, bucket, rng):
    key = "mp/big.bin"
    up = s3.create_multipart_upload(Bucket=bucket, Key=key, ContentType="application/x-big", Metadata={"m": "p"})
    uid = up["UploadId"]
    parts_data = [rng.randbytes(5 << 20), rng.randbytes(5 << 20), rng.randbytes(1234)]
    etags = []
    for n, data in enumerate(parts_data, 1):
        etags.append(s3.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=n, Body=data)["ETag"])
    # re-sending a part replaces it
    parts_data[1] = rng.randbytes(5 << 20)
    etags[1] = s3.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=2, Body=parts_data[1])["ETag"]
    listed = s3.list_parts(Bucket=bucket, Key=key, UploadId=uid)["Parts"]
    assert [(p["PartNumber"], p["ETag"], p["Size"]) for p in listed] == \
        [(n, e, len(d)) for n, (e, d) in enumerate(zip(etags, parts_data), 1)]
    ups = s3.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in ups] == [(key, uid)]
    with pytest.raises(ClientError) as e:
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": [
            {"PartNumber": 1, "ETag": etags[0]}, {"PartNumber": 2, "ETag": '"00000000000000000000000000000000"'}]})
    assert error_code(e) == "InvalidPart"
    with pytest.raises(ClientError) as e:
        s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": [
            {"PartNumber": 2, "ETag": etags[1]}, {"PartNumber": 1, "ETag": etags[0]}]})
    assert error_code(e) == "InvalidPartOrder"
    r = s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": [
        {"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]})
    want = hashlib.md5(b"".join(hashlib.md5(d).digest() for d in parts_data)).hexdigest() + "-3"
    assert r["ETag"] == f'"{want}"'
    got = s3.get_object(Bucket=bucket, Key=key)
    assert got["Body"].read() == b"".join(parts_data)
    assert got["ETag"] == f'"{want}"' and got["ContentType"] == "application/x-big" and got["Metadata"] == {"m": "p"}
    assert s3.get_object(Bucket=bucket, Key=key, PartNumber=2)["Body"].read() == parts_data[1]
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    with pytest.raises(ClientError) as e:
        s3.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"late")
    assert error_code(e) == "NoSuchUpload"


def test_multipart_errors_copy_part_and_abort(s3, bucket):
    s3.put_object(Bucket=bucket, Key="src", Body=b"0123456789" * 700_000)  # 7 MB
    uid = s3.create_multipart_upload(Bucket=bucket, Key="t")["UploadId"]
    e1 = s3.upload_part(Bucket=bucket, Key="t", UploadId=uid, PartNumber=1, Body=b"small")["ETag"]
    e2 = s3.upload_part(Bucket=bucket, Key="t", UploadId=uid, PartNumber=2, Body=b"tail")["ETag"]
    with pytest.raises(ClientError) as e:
        s3.complete_multipart_upload(Bucket=bucket, Key="t", UploadId=uid, MultipartUpload={"Parts": [
            {"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]})
    assert error_code(e) == "EntityTooSmall"
    r = s3.upload_part_copy(Bucket=bucket, Key="t", UploadId=uid, PartNumber=1, CopySource=f"{bucket}/src",
                            CopySourceRange="bytes=0-5242879")
    c1 = r["CopyPartResult"]["ETag"]
    assert c1 == f'"{hashlib.md5((b"0123456789" * 700_000)[:5 << 20]).hexdigest()}"'
    s3.complete_multipart_upload(Bucket=bucket, Key="t", UploadId=uid, MultipartUpload={"Parts": [
        {"PartNumber": 1, "ETag": c1}, {"PartNumber": 2, "ETag": e2}]})
    assert s3.get_object(Bucket=bucket, Key="t")["Body"].read() == (b"0123456789" * 700_000)[:5 << 20] + b"tail"
    uid = s3.create_multipart_upload(Bucket=bucket, Key="gone")["UploadId"]
    s3.upload_part(Bucket=bucket, Key="gone", UploadId=uid, PartNumber=1, Body=b"x")
    s3.abort_multipart_upload(Bucket=bucket, Key="gone", UploadId=uid)
    with pytest.raises(ClientError) as e:
        s3.list_parts(Bucket=bucket, Key="gone", UploadId=uid)
    assert error_code(e) == "NoSuchUpload"
    with pytest.raises(ClientError) as e:
        s3.head_object(Bucket=bucket, Key="gone")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_transfer_manager_multipart(s3, bucket, rng):
    """boto3's upload_fileobj/download_fileobj: parallel parts and ranged GETs."""
    from boto3.s3.transfer import TransferConfig

    data = rng.randbytes(24 << 20)
    cfg = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=4)
    s3.upload_fileobj(io.BytesIO(data), bucket, "tm/obj", Config=cfg)
    assert s3.head_object(Bucket=bucket, Key="tm/obj")["ETag"].endswith('-3"')
    out = io.BytesIO()
    s3.download_fileobj(bucket, "tm/obj", out, Config=cfg)
    assert out.getvalue() == data


def test_xml_error_body(gateway, s3, bucket):
    import urllib.request

    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "missing/k"})
    try:
        urllib.request.urlopen(url, timeout=30)
        raise AssertionError("expected 404")
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        assert e.code == 404 and e.headers["content-type"] == "application/xml"
        assert "<Code>NoSuchKey</Code>" in body and f"<Resource>/{bucket}/missing/k</Resource>" in body


def test_versions_listing_and_invalid_utf8_key(gateway, s3, bucket):
    import http.client

    s3.put_object(Bucket=bucket, Key="v/1", Body=b"1")
    s3.put_object(Bucket=bucket, Key="v/2", Body=b"22")
    r = s3.list_object_versions(Bucket=bucket, Prefix="v/")
    assert [(v["Key"], v["VersionId"], v["IsLatest"], v["Size"]) for v in r["Versions"]] == \
        [("v/1", "null", True, 1), ("v/2", "null", True, 2)]
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "x"})
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    conn.request("GET", url.split(str(gateway.port), 1)[1].replace("/x?", "/%ff%fe?"))
    rsp = conn.getresponse()
    body = rsp.read()
    conn.close()
    assert rsp.status in (400, 403) and (b"InvalidURI" in body or b"SignatureDoesNotMatch" in body)


def test_abandoned_temp_files_are_swept(fs, gateway):
    from threefs.s3.store import Store

    with fs.open("/.s3/tmp/abandoned-by-a-crash", "wb") as f:
        f.write(b"half an object")
    store = Store(fs.aio)
    assert fs.run(store.sweep_temp(age_s_min=0)) >= 1
    assert not fs.exists("/.s3/tmp/abandoned-by-a-crash")


def test_version_ids_and_unsupported_subresources(s3, bucket):
    s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert s3.get_object(Bucket=bucket, Key="k", VersionId="null")["Body"].read() == b"x"
    with pytest.raises(ClientError) as e:
        s3.get_object(Bucket=bucket, Key="k", VersionId="3sL4kqtJlcpXroDTDmJ-rmSpXd3dIbrHY")
    assert error_code(e) == "InvalidArgument"
    with pytest.raises(ClientError) as e:
        s3.put_object_retention(Bucket=bucket, Key="k", Retention={"Mode": "GOVERNANCE",
                                "RetainUntilDate": datetime.datetime(2030, 1, 1)})
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 501
    s3.delete_object(Bucket=bucket, Key="k", VersionId="null")


def _form(fields: dict, file_bytes: bytes, boundary: str = "----threefsformboundary") -> tuple[bytes, str]:
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="up.txt"\r\n'
                 "Content-Type: text/plain\r\n\r\n".encode() + file_bytes + f"\r\n--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def _post(gateway, bucket, body, ctype):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    try:
        conn.request("POST", f"/{bucket}", body=body, headers={"Content-Type": ctype})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


@pytest.mark.parametrize("version", ["s3v4", "s3"])
def test_browser_post_upload(gateway, admin_key, bucket, rng, version):
    from tests.s3.conftest import client_for

    s3 = client_for(gateway.endpoint, admin_key, signature_version=version)
    data = rng.randbytes(200_000)
    post = s3.generate_presigned_post(bucket, "uploads/${filename}", Fields={"success_action_status": "201",
                                      "Content-Type": "text/plain"}, Conditions=[
        ["starts-with", "$key", "uploads/"], {"success_action_status": "201"}, {"Content-Type": "text/plain"},
        ["content-length-range", 1, 1 << 20]], ExpiresIn=600)
    body, ctype = _form(post["fields"], data)
    status, text, _ = _post(gateway, bucket, body, ctype)
    assert status == 201 and b"<Key>uploads/up.txt</Key>" in text, text
    got = s3.get_object(Bucket=bucket, Key="uploads/up.txt")
    assert got["Body"].read() == data and got["ContentType"] == "text/plain"
    sig = "x-amz-signature" if "x-amz-signature" in post["fields"] else "signature"
    # a field the policy does not allow, a key outside its prefix, a bad signature: refused, nothing lands
    for change, code in (({"x-amz-meta-extra": "1"}, b"AccessDenied"), ({"key": "elsewhere/x"}, b"AccessDenied"),
                         ({sig: post["fields"][sig][:-4] + "AAAA"}, b"SignatureDoesNotMatch")):
        body, ctype = _form(dict(post["fields"], **change), data)
        status, text, _ = _post(gateway, bucket, body, ctype)
        assert status in (400, 403) and code in text, (change, status, text)
    assert [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["uploads/up.txt"]
    body, ctype = _form(post["fields"], rng.randbytes((1 << 20) + 1))
    status, text, _ = _post(gateway, bucket, body, ctype)
    assert status == 400 and b"EntityTooLarge" in text
    body, ctype = _form({"key": "anon"}, b"x")
    status, text, _ = _post(gateway, bucket, body, ctype)
    assert status == 403 and b"AccessDenied" in text


def test_listing_a_large_directory_by_pages(s3, bucket):
    """Pages that start inside one big directory read from just below the continuation point; escaped
    names (their keys sort elsewhere) are still found."""
    keys = [f"flat/{i:04d}" for i in range(0, 1200, 16)] + ["flat/!x", "flat/%p", "flat/", "flat/.", "flat/" + "z" * 300,
                                                           "flat/0100/in", "flat/05", "flat0"]
    for k in keys:
        s3.put_object(Bucket=bucket, Key=k, Body=b"")
    want = sorted(keys, key=lambda k: k.encode())
    got, token = [], None
    while True:
        kw = {"ContinuationToken": token} if token else {}
        r = s3.list_objects_v2(Bucket=bucket, MaxKeys=11, **kw)
        got += [o["Key"] for o in r.get("Contents", [])]
        if not r["IsTruncated"]:
            break
        token = r["NextContinuationToken"]
    assert got == want
    for prefix in ("flat/0", "flat/01", "flat/!", "flat/%", "flat/z", "flat/.", "flat/05"):
        r = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
        assert [o["Key"] for o in r.get("Contents", [])] == [k for k in want if k.startswith(prefix)], prefix
    r = s3.list_objects_v2(Bucket=bucket, Prefix="flat/0", Delimiter="/", StartAfter="flat/0500")
    assert [o["Key"] for o in r["Contents"]] == [k for k in want if k.startswith("flat/0") and k > "flat/0500"
                                                 and "/" not in k[5:]]
