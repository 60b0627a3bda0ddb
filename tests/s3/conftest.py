"""S3 gateway fixtures: real gateway processes (uvicorn) on the shared real cluster, real clients."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys

import pytest

from threefs.cli.s3_cmd import wait_listening
from threefs.common.net import free_port

_buckets = itertools.count()


class Gateway:
    def __init__(self, cluster, tmp, *extra: str, env: dict | None = None):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"gateway-{self.port}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "threefs.s3.server", "--config", str(cluster.client_config_path),
             "--port", str(self.port), *extra], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=dict(os.environ, **(env or {})))
        log.close()
        try:
            wait_listening("127.0.0.1", self.port, self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="session")
def admin_key(fs):
    from threefs.s3.keys import add_key

    return add_key(fs, "/", "root", 0, 0)


@pytest.fixture(scope="session")
def gateway(cluster, fs, admin_key, tmp_path_factory):
    g = Gateway(cluster, tmp_path_factory.mktemp("s3"), env={"THREEFS_S3_KEY_CACHE_S": "1"})
    yield g
    g.stop()
    assert "Traceback" not in g.log(), g.log()[-3000:]


def client_for(endpoint: str, key: tuple[str, str], **config):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key[0], aws_secret_access_key=key[1],
                        region_name="us-east-1",
                        config=Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"}, **config))


@pytest.fixture(scope="session")
def s3(gateway, admin_key):
    return client_for(gateway.endpoint, admin_key)


@pytest.fixture
def bucket(s3):
    name = f"b{os.getpid()}-{next(_buckets)}"
    s3.create_bucket(Bucket=name)
    yield name
    _empty(s3, name)
    s3.delete_bucket(Bucket=name)


def _empty(s3, name: str) -> None:
    for up in s3.list_multipart_uploads(Bucket=name).get("Uploads", []):
        s3.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
    while True:
        keys = [{"Key": o["Key"]} for o in s3.list_objects_v2(Bucket=name).get("Contents", [])]
        if not keys:
            return
        s3.delete_objects(Bucket=name, Delete={"Objects": keys})


def error_code(exc_info) -> str:
    return exc_info.value.response["Error"]["Code"]
