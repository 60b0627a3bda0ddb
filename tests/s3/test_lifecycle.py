"""Bucket lifecycle configurations, and the expiry a gateway carries out (a gateway with a 0.5 s pass
interval; objects are made old by setting their mtime through the client)."""

from __future__ import annotations

import json
import time

import pytest
from botocore.exceptions import ClientError

from tests.s3.conftest import Gateway, client_for

DAY_NS = 86400 * 10**9


def error_code(e) -> str:
    return e.value.response["Error"]["Code"]


@pytest.fixture(scope="module")
def lc(cluster, gateway, admin_key, tmp_path_factory):
    g = Gateway(cluster, tmp_path_factory.mktemp("s3-lc"), env={"THREEFS_S3_LIFECYCLE_INTERVAL_S": "0.5"})
    yield client_for(g.endpoint, admin_key)
    g.stop()


def rules_of(s3, bucket):
    return s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]


def test_configuration_round_trip(s3, bucket):
    with pytest.raises(ClientError) as e:
        s3.get_bucket_lifecycle_configuration(Bucket=bucket)
    assert error_code(e) == "NoSuchLifecycleConfiguration"
    rules = [
        {"ID": "tmp", "Filter": {"Prefix": "tmp/"}, "Status": "Enabled", "Expiration": {"Days": 3}},
        {"ID": "tagged", "Filter": {"And": {"Prefix": "logs/", "Tags": [{"Key": "kind", "Value": "debug"}]}},
         "Status": "Disabled", "Expiration": {"Date": "2031-01-01T00:00:00Z"}},
        {"ID": "uploads", "Filter": {"Prefix": ""}, "Status": "Enabled",
         "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 2},
         "NoncurrentVersionExpiration": {"NoncurrentDays": 5}},
    ]
    s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": rules})
    got = rules_of(s3, bucket)
    assert [r["ID"] for r in got] == ["tmp", "tagged", "uploads"]
    assert got[0]["Expiration"] == {"Days": 3} and got[0]["Filter"] == {"Prefix": "tmp/"}
    assert got[1]["Status"] == "Disabled" and got[1]["Filter"]["And"]["Tags"] == [{"Key": "kind", "Value": "debug"}]
    assert got[1]["Expiration"]["Date"].year == 2031
    assert got[2]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 2}
    s3.delete_bucket_lifecycle(Bucket=bucket)
    with pytest.raises(ClientError) as e:
        s3.get_bucket_lifecycle_configuration(Bucket=bucket)
    assert error_code(e) == "NoSuchLifecycleConfiguration"


@pytest.mark.parametrize("rule, code", [
    ({"ID": "x", "Filter": {"Prefix": ""}, "Status": "Enabled", "Expiration": {"Days": 0}}, "InvalidArgument"),
    ({"ID": "x" * 256, "Filter": {"Prefix": ""}, "Status": "Enabled", "Expiration": {"Days": 1}}, "InvalidArgument"),
    ({"ID": "x", "Filter": {"Prefix": ""}, "Status": "Enabled",
      "Expiration": {"Date": "2031-01-01T12:00:00Z"}}, "InvalidArgument"),
    ({"ID": "x", "Filter": {"Prefix": ""}, "Status": "Enabled",
      "Transitions": [{"Days": 1, "StorageClass": "GLACIER"}]}, "NotImplemented"),
])
def test_bad_rules(s3, bucket, rule, code):
    with pytest.raises(ClientError) as e:
        s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [rule]})
    assert error_code(e) == code
    same = {"ID": "dup", "Filter": {"Prefix": ""}, "Status": "Enabled", "Expiration": {"Days": 1}}
    with pytest.raises(ClientError) as e:
        s3.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [same, same]})
    assert error_code(e) == "InvalidArgument"


def test_expiry_and_abort_are_carried_out(lc, fs, bucket):
    for key in ("tmp/old", "tmp/new", "keep/old", "logs/debug-old", "logs/info-old"):
        lc.put_object(Bucket=bucket, Key=key, Body=b"x")
    lc.put_object_tagging(Bucket=bucket, Key="logs/debug-old", Tagging={"TagSet": [{"Key": "kind", "Value": "debug"}]})
    now_ns = time.time_ns()
    for key in ("tmp/old", "keep/old", "logs/debug-old", "logs/info-old"):
        fs.utime(f"/{bucket}/{key}", ns=(now_ns - 3 * DAY_NS, now_ns - 3 * DAY_NS))
    upload = lc.create_multipart_upload(Bucket=bucket, Key="big")["UploadId"]
    fresh = lc.create_multipart_upload(Bucket=bucket, Key="big2")["UploadId"]
    info_path = f"/.s3/uploads/{bucket}/{upload}/info"
    with fs.open(info_path, "rb") as f:
        info = json.loads(f.read())
    info["initiated"] -= 3 * 86400
    with fs.open(info_path, "wb") as f:
        f.write(json.dumps(info).encode())
    lc.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [
        {"ID": "tmp", "Filter": {"Prefix": "tmp/"}, "Status": "Enabled", "Expiration": {"Days": 2}},
        {"ID": "debug", "Filter": {"And": {"Prefix": "logs/", "Tags": [{"Key": "kind", "Value": "debug"}]}},
         "Status": "Enabled", "Expiration": {"Days": 1}},
        {"ID": "off", "Filter": {"Prefix": "keep/"}, "Status": "Disabled", "Expiration": {"Days": 1}},
        {"ID": "uploads", "Filter": {"Prefix": ""}, "Status": "Enabled",
         "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}},
    ]})
    deadline = time.monotonic() + 60
    while True:
        keys = sorted(o["Key"] for o in lc.list_objects_v2(Bucket=bucket).get("Contents", []))
        uploads = [u["UploadId"] for u in lc.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
        if keys == ["keep/old", "logs/info-old", "tmp/new"] and uploads == [fresh]:
            break
        assert time.monotonic() < deadline, (keys, uploads)
        time.sleep(0.3)
    lc.abort_multipart_upload(Bucket=bucket, Key="big2", UploadId=fresh)
