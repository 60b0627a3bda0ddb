"""Bucket CORS and bucket tags through boto3 and raw HTTP (browsers' preflights are unauthenticated)."""

from __future__ import annotations

import http.client

import pytest
from botocore.exceptions import ClientError

from tests.s3.conftest import Gateway, client_for


def error_code(e) -> str:
    return e.value.response["Error"]["Code"]


def raw(gateway, method: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
    try:
        conn.request(method, path, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def other(cluster, gateway, admin_key, tmp_path_factory):
    g = Gateway(cluster, tmp_path_factory.mktemp("s3-cors"))
    yield g, client_for(g.endpoint, admin_key)
    g.stop()


RULES = [
    {"ID": "uploads", "AllowedOrigins": ["https://*.example.com"], "AllowedMethods": ["PUT", "POST"],
     "AllowedHeaders": ["content-*", "x-amz-*"], "ExposeHeaders": ["ETag"], "MaxAgeSeconds": 600},
    {"AllowedOrigins": ["*"], "AllowedMethods": ["GET", "HEAD"]},
]


def test_cors_configuration_and_preflights(s3, gateway, other, bucket):
    other_gateway, other_s3 = other
    with pytest.raises(ClientError) as e:
        s3.get_bucket_cors(Bucket=bucket)
    assert error_code(e) == "NoSuchCORSConfiguration"
    status, _, body = raw(gateway, "OPTIONS", f"/{bucket}/k", {"Origin": "https://a.example.com",
                                                               "Access-Control-Request-Method": "GET"})
    assert status == 403 and b"AccessForbidden" in body  # no configuration: refused
    raw(other_gateway, "OPTIONS", f"/{bucket}/k", {"Origin": "x", "Access-Control-Request-Method": "GET"})
    s3.put_bucket_cors(Bucket=bucket, CORSConfiguration={"CORSRules": RULES})
    got = s3.get_bucket_cors(Bucket=bucket)["CORSRules"]
    assert got[0]["AllowedOrigins"] == ["https://*.example.com"] and got[0]["MaxAgeSeconds"] == 600
    assert got[1]["AllowedMethods"] == ["GET", "HEAD"] and len(got) == 2
    for g in (gateway, other_gateway):  # the other gateway had cached "no configuration"
        status, h, _ = raw(g, "OPTIONS", f"/{bucket}/up/k", {
            "Origin": "https://app.example.com", "Access-Control-Request-Method": "PUT",
            "Access-Control-Request-Headers": "Content-Type, X-Amz-Date"})
        assert status == 200, (g.port, h)
        assert h["access-control-allow-origin"] == "https://app.example.com"
        assert h["access-control-allow-methods"] == "PUT, POST"
        assert h["access-control-allow-headers"] == "content-type, x-amz-date"
        assert h["access-control-max-age"] == "600" and h["access-control-expose-headers"] == "ETag"
    status, h, _ = raw(gateway, "OPTIONS", f"/{bucket}/k", {"Origin": "https://evil.org",
                                                            "Access-Control-Request-Method": "PUT"})
    assert status == 403  # PUT only from *.example.com
    status, _, _ = raw(gateway, "OPTIONS", f"/{bucket}/k", {
        "Origin": "https://app.example.com", "Access-Control-Request-Method": "PUT",
        "Access-Control-Request-Headers": "authorization"})
    assert status == 403  # a header no rule allows
    status, h, _ = raw(gateway, "OPTIONS", f"/{bucket}/k", {"Origin": "https://evil.org",
                                                            "Access-Control-Request-Method": "GET"})
    assert status == 200 and h["access-control-allow-origin"] == "*"
    status, _, body = raw(gateway, "OPTIONS", f"/{bucket}/k", {"Access-Control-Request-Method": "GET"})
    assert status == 400 and b"Origin" in body

    # a signed request with an Origin gets the headers of the rule that matches it
    s3.put_object(Bucket=bucket, Key="k", Body=b"hello")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "k"})
    path = url.split(f":{gateway.port}", 1)[1]
    status, h, body = raw(gateway, "GET", path, {"Origin": "https://site.test"})
    assert status == 200 and body == b"hello" and h["access-control-allow-origin"] == "*"
    status, h, _ = raw(gateway, "GET", path, {})
    assert "access-control-allow-origin" not in h

    s3.delete_bucket_cors(Bucket=bucket)
    with pytest.raises(ClientError) as e:
        other_s3.get_bucket_cors(Bucket=bucket)
    assert error_code(e) == "NoSuchCORSConfiguration"


@pytest.mark.parametrize("rule, code", [
    ({"AllowedOrigins": ["*"], "AllowedMethods": ["PATCH"]}, "InvalidRequest"),
    ({"AllowedOrigins": ["*.*.example.com"], "AllowedMethods": ["GET"]}, "InvalidRequest"),
])
def test_bad_cors_rules(s3, bucket, rule, code):
    with pytest.raises(ClientError) as e:
        s3.put_bucket_cors(Bucket=bucket, CORSConfiguration={"CORSRules": [rule]})
    assert error_code(e) == code
    with pytest.raises(ClientError):
        s3.get_bucket_cors(Bucket=bucket)  # nothing stored


def test_bucket_tagging(s3, other, bucket):
    _, other_s3 = other
    with pytest.raises(ClientError) as e:
        s3.get_bucket_tagging(Bucket=bucket)
    assert error_code(e) == "NoSuchTagSet"
    tags = [{"Key": f"k{i}", "Value": f"v{i}"} for i in range(50)]
    s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": tags})
    assert other_s3.get_bucket_tagging(Bucket=bucket)["TagSet"] == tags
    with pytest.raises(ClientError) as e:
        s3.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": tags + [{"Key": "one", "Value": "more"}]})
    assert error_code(e) == "InvalidTag"
    s3.delete_bucket_tagging(Bucket=bucket)
    with pytest.raises(ClientError) as e:
        other_s3.get_bucket_tagging(Bucket=bucket)
    assert error_code(e) == "NoSuchTagSet"


def test_bucket_configuration_does_not_outlive_its_bucket(s3):
    name = "cfg-outlives-test"
    s3.create_bucket(Bucket=name)
    s3.put_bucket_tagging(Bucket=name, Tagging={"TagSet": [{"Key": "a", "Value": "b"}]})
    s3.put_bucket_cors(Bucket=name, CORSConfiguration={"CORSRules": RULES})
    s3.delete_bucket(Bucket=name)
    s3.create_bucket(Bucket=name)
    try:
        with pytest.raises(ClientError) as e:
            s3.get_bucket_tagging(Bucket=name)
        assert error_code(e) == "NoSuchTagSet"
        with pytest.raises(ClientError) as e:
            s3.get_bucket_cors(Bucket=name)
        assert error_code(e) == "NoSuchCORSConfiguration"
    finally:
        s3.delete_bucket(Bucket=name)
