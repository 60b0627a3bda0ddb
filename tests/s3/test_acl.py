"""Canned ACLs mapped onto POSIX modes, ACL bodies, and anonymous requests (served only where an S3 ACL
made a bucket or object public)."""

from __future__ import annotations

import os

import boto3
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError

from tests.s3.conftest import client_for
from tests.s3.test_auth import _cli, _key_from

ALL_USERS = "http://acs.amazonaws.com/groups/global/AllUsers"
AUTH_USERS = "http://acs.amazonaws.com/groups/global/AuthenticatedUsers"


def error_code(e) -> str:
    return e.value.response["Error"]["Code"]


@pytest.fixture(scope="module")
def anon(gateway):
    return boto3.client("s3", endpoint_url=gateway.endpoint, region_name="us-east-1",
                        config=Config(signature_version=UNSIGNED, retries={"max_attempts": 1},
                                      s3={"addressing_style": "path"}))


@pytest.fixture(scope="module")
def other_user(cluster, gateway):
    name = f"acluser{os.getpid()}"
    _cli(cluster, "admin", "user-add", name, "--uid", "4555")
    return client_for(gateway.endpoint, _key_from(_cli(cluster, "admin", "s3-key-add", name)))


def grants(policy) -> set:
    return {(g["Grantee"].get("URI") or g["Grantee"].get("ID"), g["Permission"]) for g in policy["Grants"]}


def test_canned_bucket_acls_and_anonymous_reads(s3, anon, fs, bucket):
    s3.put_object(Bucket=bucket, Key="plain", Body=b"not public")
    s3.put_object(Bucket=bucket, Key="pub", Body=b"public", ACL="public-read")
    assert grants(s3.get_bucket_acl(Bucket=bucket)) == {("0", "FULL_CONTROL")}
    assert fs.stat(f"/{bucket}").mode & 0o777 == 0o700
    with pytest.raises(ClientError) as e:
        anon.list_objects_v2(Bucket=bucket)
    assert error_code(e) == "AccessDenied"
    # a public object in a private bucket is readable by anyone (S3's object ACLs); a missing key is
    # AccessDenied, not NoSuchKey, to those who may not list
    assert anon.get_object(Bucket=bucket, Key="pub")["Body"].read() == b"public"
    assert grants(s3.get_object_acl(Bucket=bucket, Key="pub")) == {("0", "FULL_CONTROL"), (ALL_USERS, "READ")}
    for key in ("plain", "missing"):
        with pytest.raises(ClientError) as e:
            anon.get_object(Bucket=bucket, Key=key)
        assert error_code(e) == "AccessDenied", key

    s3.put_bucket_acl(Bucket=bucket, ACL="public-read")
    assert fs.stat(f"/{bucket}").mode & 0o777 == 0o755
    assert grants(s3.get_bucket_acl(Bucket=bucket)) == {("0", "FULL_CONTROL"), (ALL_USERS, "READ")}
    assert [o["Key"] for o in anon.list_objects_v2(Bucket=bucket)["Contents"]] == ["plain", "pub"]
    with pytest.raises(ClientError) as e:
        anon.get_object(Bucket=bucket, Key="plain")  # listing is the bucket's; reading is the object's
    assert error_code(e) == "AccessDenied"
    with pytest.raises(ClientError) as e:
        anon.get_object(Bucket=bucket, Key="missing")
    assert error_code(e) == "NoSuchKey"
    with pytest.raises(ClientError) as e:
        anon.put_object(Bucket=bucket, Key="intrude", Body=b"x")
    assert error_code(e) == "AccessDenied"

    s3.put_bucket_acl(Bucket=bucket, ACL="private")
    assert fs.stat(f"/{bucket}").mode & 0o777 == 0o700
    with pytest.raises(ClientError) as e:
        anon.list_objects_v2(Bucket=bucket)
    assert error_code(e) == "AccessDenied"


def test_public_read_write_bucket_takes_anonymous_writes(s3, anon, fs):
    name = f"prw{os.getpid()}"
    s3.create_bucket(Bucket=name, ACL="public-read-write")
    try:
        assert fs.stat(f"/{name}").mode & 0o777 == 0o777
        anon.put_object(Bucket=name, Key="dropped", Body=b"from anyone")
        assert s3.get_object(Bucket=name, Key="dropped")["Body"].read() == b"from anyone"
        assert fs.stat(f"/{name}/dropped").uid == 0  # made for the bucket's owner
        anon.delete_object(Bucket=name, Key="dropped")
        with pytest.raises(ClientError) as e:
            anon.put_bucket_acl(Bucket=name, ACL="private")  # never an ACL change
        assert error_code(e) == "AccessDenied"
    finally:
        s3.delete_bucket(Bucket=name)


def test_world_readable_files_made_outside_s3_are_not_anonymous(s3, anon, fs):
    name = f"fusemade{os.getpid()}"
    fs.mkdir(f"/{name}", mode=0o755)
    with fs.open(f"/{name}/f", "wb") as f:
        f.write(b"posix 0644")
    try:
        assert s3.get_object(Bucket=name, Key="f")["Body"].read() == b"posix 0644"
        for call in (lambda: anon.get_object(Bucket=name, Key="f"), lambda: anon.list_objects_v2(Bucket=name)):
            with pytest.raises(ClientError) as e:
                call()
            assert error_code(e) == "AccessDenied"
    finally:
        fs.remove_tree(f"/{name}")


def test_object_acls_are_modes_for_other_users(s3, other_user, fs, bucket):
    s3.put_bucket_acl(Bucket=bucket, ACL="authenticated-read")
    assert grants(s3.get_bucket_acl(Bucket=bucket)) == {("0", "FULL_CONTROL"), (AUTH_USERS, "READ")}
    s3.put_object(Bucket=bucket, Key="default", Body=b"d")
    s3.put_object(Bucket=bucket, Key="secret", Body=b"s", ACL="private")
    assert fs.stat(f"/{bucket}/secret").mode & 0o777 == 0o600
    assert other_user.get_object(Bucket=bucket, Key="default")["Body"].read() == b"d"
    with pytest.raises(ClientError) as e:
        other_user.get_object(Bucket=bucket, Key="secret")
    assert error_code(e) == "AccessDenied"
    assert grants(s3.get_object_acl(Bucket=bucket, Key="secret")) == {("0", "FULL_CONTROL")}
    s3.put_object_acl(Bucket=bucket, Key="secret", ACL="authenticated-read")
    assert other_user.get_object(Bucket=bucket, Key="secret")["Body"].read() == b"s"
    with pytest.raises(ClientError) as e:  # only the owner changes an ACL
        other_user.put_object_acl(Bucket=bucket, Key="secret", ACL="private")
    assert error_code(e) == "AccessDenied"
    with pytest.raises(ClientError) as e:
        other_user.put_bucket_acl(Bucket=bucket, ACL="public-read")
    assert error_code(e) == "AccessDenied"


def test_acl_bodies_and_grants_modes_cannot_hold(s3, anon, bucket):
    s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    owner = s3.get_object_acl(Bucket=bucket, Key="k")["Owner"]
    full = {"Grantee": {"Type": "CanonicalUser", "ID": owner["ID"]}, "Permission": "FULL_CONTROL"}
    read_all = {"Grantee": {"Type": "Group", "URI": ALL_USERS}, "Permission": "READ"}
    s3.put_object_acl(Bucket=bucket, Key="k", AccessControlPolicy={"Owner": owner, "Grants": [full, read_all]})
    assert anon.get_object(Bucket=bucket, Key="k")["Body"].read() == b"x"
    other = {"Grantee": {"Type": "CanonicalUser", "ID": "4555"}, "Permission": "READ"}
    with pytest.raises(ClientError) as e:
        s3.put_object_acl(Bucket=bucket, Key="k", AccessControlPolicy={"Owner": owner, "Grants": [full, other]})
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 501
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="g", Body=b"x", GrantRead='id="4555"')
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 501
    with pytest.raises(ClientError) as e:
        s3.put_object(Bucket=bucket, Key="g", Body=b"x", ACL="no-such-acl")
    assert error_code(e) == "InvalidArgument"
    s3.copy_object(Bucket=bucket, Key="k2", CopySource={"Bucket": bucket, "Key": "k"}, ACL="public-read")
    assert anon.get_object(Bucket=bucket, Key="k2")["Body"].read() == b"x"
    s3.copy_object(Bucket=bucket, Key="k3", CopySource={"Bucket": bucket, "Key": "k"})
    with pytest.raises(ClientError):
        anon.get_object(Bucket=bucket, Key="k3")  # a copy does not take its source's ACL (S3 neither)
