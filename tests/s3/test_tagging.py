"""Object tags through boto3: Put/Get/DeleteObjectTagging, x-amz-tagging on PUT, multipart and copy,
S3's limits, and a second gateway seeing every change at once."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from tests.s3.conftest import Gateway, client_for


def error_code(e) -> str:
    return e.value.response["Error"]["Code"]


def tagset(s3, bucket, key) -> dict:
    return {t["Key"]: t["Value"] for t in s3.get_object_tagging(Bucket=bucket, Key=key)["TagSet"]}


@pytest.fixture(scope="module")
def other(cluster, gateway, admin_key, tmp_path_factory):
    g = Gateway(cluster, tmp_path_factory.mktemp("s3-tags"))
    yield client_for(g.endpoint, admin_key)
    g.stop()


def test_put_get_delete_tagging(s3, other, bucket):
    s3.put_object(Bucket=bucket, Key="a/k", Body=b"data", Metadata={"m": "1"})
    assert tagset(s3, bucket, "a/k") == {}
    other.head_object(Bucket=bucket, Key="a/k")  # the other gateway caches the untagged record
    tags = [{"Key": "project", "Value": "llm"}, {"Key": "empty", "Value": ""},
            {"Key": "k" * 128, "Value": "v" * 256}, {"Key": "ünï & <x>", "Value": "välue/=&"}]
    s3.put_object_tagging(Bucket=bucket, Key="a/k", Tagging={"TagSet": tags})
    want = {t["Key"]: t["Value"] for t in tags}
    assert tagset(s3, bucket, "a/k") == want and tagset(other, bucket, "a/k") == want
    head = other.head_object(Bucket=bucket, Key="a/k")
    assert head["ResponseMetadata"]["HTTPHeaders"]["x-amz-tagging-count"] == "4"
    assert head["Metadata"] == {"m": "1"} and head["ContentLength"] == 4
    got = s3.get_object(Bucket=bucket, Key="a/k")
    assert got["TagCount"] == 4 and got["Body"].read() == b"data"
    s3.delete_object_tagging(Bucket=bucket, Key="a/k")
    assert tagset(s3, bucket, "a/k") == {} and tagset(other, bucket, "a/k") == {}
    assert "TagCount" not in other.get_object(Bucket=bucket, Key="a/k")
    with pytest.raises(ClientError) as e:
        s3.get_object_tagging(Bucket=bucket, Key="missing")
    assert error_code(e) == "NoSuchKey"


@pytest.mark.parametrize("tags, what", [
    ([{"Key": f"k{i}", "Value": "v"} for i in range(11)], "eleven tags"),
    ([{"Key": "k" * 129, "Value": "v"}], "a 129-character key"),
    ([{"Key": "k", "Value": "v" * 257}], "a 257-character value"),
    ([{"Key": "k", "Value": "1"}, {"Key": "k", "Value": "2"}], "a key twice"),
    ([{"Key": "aws:reserved", "Value": "v"}], "the aws: prefix"),
])
def test_tag_limits(s3, bucket, tags, what):
    s3.put_object(Bucket=bucket, Key="k", Body=b"x", Tagging="keep=1")
    with pytest.raises(ClientError) as e:
        s3.put_object_tagging(Bucket=bucket, Key="k", Tagging={"TagSet": tags})
    assert error_code(e) == "InvalidTag", what
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert tagset(s3, bucket, "k") == {"keep": "1"}  # nothing changed


def test_tagging_header_on_put_multipart_and_copy(s3, bucket, rng):
    s3.put_object(Bucket=bucket, Key="p", Body=b"x", Tagging="a=1&b=two%20words")
    assert tagset(s3, bucket, "p") == {"a": "1", "b": "two words"}
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="bad", Body=b"x", Tagging="&".join(f"k{i}=v" for i in range(11)))
    assert error_code(e) == "InvalidTag"
    with pytest.raises(ClientError):
        s3.head_object(Bucket=bucket, Key="bad")  # refused before anything was stored
    up = s3.create_multipart_upload(Bucket=bucket, Key="mp", Tagging="stage=raw")["UploadId"]
    part = s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=1, Body=rng.randbytes(1000))
    s3.complete_multipart_upload(Bucket=bucket, Key="mp", UploadId=up,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]})
    assert tagset(s3, bucket, "mp") == {"stage": "raw"}
    s3.copy_object(Bucket=bucket, Key="c1", CopySource={"Bucket": bucket, "Key": "p"})
    assert tagset(s3, bucket, "c1") == {"a": "1", "b": "two words"}  # COPY is the default
    s3.copy_object(Bucket=bucket, Key="c2", CopySource={"Bucket": bucket, "Key": "p"},
                   TaggingDirective="REPLACE", Tagging="new=yes")
    assert tagset(s3, bucket, "c2") == {"new": "yes"}
    s3.copy_object(Bucket=bucket, Key="c3", CopySource={"Bucket": bucket, "Key": "p"},
                   MetadataDirective="REPLACE", Metadata={"x": "y"})
    assert tagset(s3, bucket, "c3") == {"a": "1", "b": "two words"}
    s3.put_object(Bucket=bucket, Key="p", Body=b"replaced")
    assert tagset(s3, bucket, "p") == {}  # a new object: its own (no) tags


def test_tags_on_a_file_written_outside_the_gateway(s3, fs, bucket):
    with fs.open(f"/{bucket}/outside", "wb") as f:
        f.write(b"from the client")
    etag = s3.head_object(Bucket=bucket, Key="outside")["ETag"]
    s3.put_object_tagging(Bucket=bucket, Key="outside", Tagging={"TagSet": [{"Key": "t", "Value": "1"}]})
    assert tagset(s3, bucket, "outside") == {"t": "1"}
    head = s3.head_object(Bucket=bucket, Key="outside")
    assert head["ETag"] == etag and head["ContentLength"] == len(b"from the client")


def test_malformed_tagging_xml(gateway, admin_key, bucket, s3):
    s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    client = client_for(gateway.endpoint, admin_key)

    def send_body(request, **kwargs):
        request.data = b"<Tagging><TagSet><Tag><Key>only-a-key</Key></Tag></TagSet></Tagging>"
        for h in [h for h in request.headers.keys() if h.lower() == "content-md5"
                  or h.lower().startswith("x-amz-checksum") or h.lower().startswith("x-amz-sdk-checksum")]:
            del request.headers[h]

    client.meta.events.register("before-sign.s3.PutObjectTagging", send_body)
    with pytest.raises(ClientError) as e:
        client.put_object_tagging(Bucket=bucket, Key="k", Tagging={"TagSet": [{"Key": "a", "Value": "b"}]})
    assert error_code(e) == "MalformedXML"
