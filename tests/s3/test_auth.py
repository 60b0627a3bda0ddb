"""Access keys: wrong key, wrong secret, presigned URLs and their expiry, threefs users' permissions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from botocore.exceptions import ClientError

from tests.s3.conftest import client_for, error_code


def _cli(cluster, *args) -> str:
    r = subprocess.run([sys.executable, "-m", "threefs.cli.main", "--config", str(cluster.client_config_path),
                        *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _key_from(out: str) -> tuple[str, str]:
    values = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("AWS_"))
    return values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"]


def test_wrong_key_wrong_secret_anonymous(gateway, admin_key, bucket):
    bad_key = client_for(gateway.endpoint, ("TFSNOSUCHKEY00000000", admin_key[1]))
    with pytest.raises(ClientError) as e:
        bad_key.list_objects_v2(Bucket=bucket)
    assert error_code(e) == "InvalidAccessKeyId"
    wrong_last = "y" if admin_key[1].endswith("x") else "x"  # (a secret ending in "x" made this the real one)
    bad_secret = client_for(gateway.endpoint, (admin_key[0], admin_key[1][:-1] + wrong_last))
    with pytest.raises(ClientError) as e:
        bad_secret.put_object(Bucket=bucket, Key="k", Body=b"x")
    assert error_code(e) == "SignatureDoesNotMatch"
    try:
        urllib.request.urlopen(f"{gateway.endpoint}/{bucket}/k", timeout=30)
        raise AssertionError("anonymous GET served")
    except urllib.error.HTTPError as e:
        assert e.code == 403 and b"<Code>AccessDenied</Code>" in e.read()


@pytest.mark.parametrize("version", ["s3v4", "s3"])
def test_presigned_urls(gateway, admin_key, bucket, version):
    s3 = client_for(gateway.endpoint, admin_key, signature_version=version)
    s3.put_object(Bucket=bucket, Key="p/obj", Body=b"presigned body")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "p/obj"}, ExpiresIn=600)
    assert urllib.request.urlopen(url, timeout=30).read() == b"presigned body"
    put = s3.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "p/up"}, ExpiresIn=600)
    req = urllib.request.Request(put, data=b"uploaded", method="PUT", headers={"Content-Type": ""})
    assert urllib.request.urlopen(req, timeout=30).status == 200
    assert s3.get_object(Bucket=bucket, Key="p/up")["Body"].read() == b"uploaded"
    tampered = url.replace("p%2Fobj", "p%2Fup").replace("p/obj", "p/up")
    try:
        urllib.request.urlopen(tampered, timeout=30)
        raise AssertionError("a URL signed for another key was served")
    except urllib.error.HTTPError as e:
        assert e.code == 403 and b"SignatureDoesNotMatch" in e.read()
    short = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "p/obj"}, ExpiresIn=1)
    time.sleep(2.1)  # past its expiry (no timing assertion: the URL must simply be refused now)
    try:
        urllib.request.urlopen(short, timeout=30)
        raise AssertionError("an expired URL was served")
    except urllib.error.HTTPError as e:
        body = e.read()
        assert e.code == 403 and b"<Code>AccessDenied</Code>" in body and b"expired" in body


def test_user_keys_apply_threefs_permissions(cluster, gateway, s3, bucket, fs):
    name = f"s3user{os.getpid()}"
    _cli(cluster, "admin", "user-add", name, "--uid", "4321")
    user = client_for(gateway.endpoint, _key_from(_cli(cluster, "admin", "s3-key-add", name)))
    s3.put_object(Bucket=bucket, Key="root-owned", Body=b"public read")
    with pytest.raises(ClientError) as e:  # buckets are private (0700) as in S3 ...
        user.get_object(Bucket=bucket, Key="root-owned")
    assert error_code(e) == "AccessDenied"
    with pytest.raises(ClientError) as e:
        user.head_bucket(Bucket=bucket)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    fs.chmod(f"/{bucket}", 0o755)  # ... until the owner shares it: POSIX permissions are what apply
    assert user.get_object(Bucket=bucket, Key="root-owned")["Body"].read() == b"public read"  # 0644
    with pytest.raises(ClientError) as e:
        user.put_object(Bucket=bucket, Key="intrude", Body=b"x")  # 0755: not writable to others
    assert error_code(e) == "AccessDenied"
    with pytest.raises(ClientError) as e:
        user.delete_object(Bucket=bucket, Key="root-owned")
    assert error_code(e) == "AccessDenied"
    assert user.get_object_tagging(Bucket=bucket, Key="root-owned")["TagSet"] == []  # readable ...
    with pytest.raises(ClientError) as e:  # ... but changing tags is a write
        user.put_object_tagging(Bucket=bucket, Key="root-owned", Tagging={"TagSet": [{"Key": "a", "Value": "b"}]})
    assert error_code(e) == "AccessDenied"
    with pytest.raises(ClientError) as e:  # bucket configurations are the owner's
        user.put_bucket_tagging(Bucket=bucket, Tagging={"TagSet": [{"Key": "a", "Value": "b"}]})
    assert error_code(e) == "AccessDenied"
    assert s3.get_object(Bucket=bucket, Key="root-owned")["Body"].read() == b"public read"
    fs.chmod(f"/{bucket}/root-owned", 0o600)
    with pytest.raises(ClientError) as e:
        user.get_object(Bucket=bucket, Key="root-owned")
    assert error_code(e) == "AccessDenied"
    own = f"own-{os.getpid()}"
    user.create_bucket(Bucket=own)
    try:
        user.put_object(Bucket=own, Key="mine/file", Body=b"user data")
        assert fs.stat(f"/{own}/mine/file").uid == 4321  # objects belong to the key's user
        assert [b["Name"] for b in user.list_buckets()["Buckets"]] == [own]
        assert s3.get_object(Bucket=own, Key="mine/file")["Body"].read() == b"user data"
        with pytest.raises(ClientError) as e:  # copying needs read permission on the source too
            user.copy_object(Bucket=own, Key="stolen", CopySource=f"{bucket}/root-owned")
        assert error_code(e) == "AccessDenied"
        user.delete_object(Bucket=own, Key="mine/file")
    finally:
        user.delete_bucket(Bucket=own)


def test_key_list_and_revoke(cluster, gateway, bucket):
    key = _key_from(_cli(cluster, "admin", "s3-key-add", "root"))
    assert key[0] in _cli(cluster, "admin", "s3-key-list")
    assert key[1] not in _cli(cluster, "admin", "s3-key-list")
    c = client_for(gateway.endpoint, key)
    c.list_objects_v2(Bucket=bucket)
    _cli(cluster, "admin", "s3-key-revoke", key[0])
    deadline = time.monotonic() + 30
    while True:  # gateways cache keys for a few seconds
        try:
            c.list_objects_v2(Bucket=bucket)
        except ClientError as e:
            assert e.response["Error"]["Code"] == "InvalidAccessKeyId"
            break
        assert time.monotonic() < deadline, "a revoked key kept working"
        time.sleep(0.5)


def test_secrets_are_sealed_at_rest(fs, admin_key):
    raw = fs.read_bytes(f"/.s3/keys/{admin_key[0]}")
    assert admin_key[1].encode() not in raw
    assert oct(fs.stat("/.s3/keys").mode & 0o777) == "0o700"
