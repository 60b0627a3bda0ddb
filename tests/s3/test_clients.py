"""s3fs, pyarrow's S3FileSystem and the aws CLI against a real gateway."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def test_s3fs(gateway, admin_key, bucket, rng):
    import s3fs

    fs = s3fs.S3FileSystem(key=admin_key[0], secret=admin_key[1], use_listings_cache=False,
                           client_kwargs={"endpoint_url": gateway.endpoint, "region_name": "us-east-1"})
    data = rng.randbytes(12 << 20)  # above s3fs's 5 MiB block: a multipart upload
    with fs.open(f"{bucket}/s3fs/big.bin", "wb", block_size=5 << 20) as f:
        f.write(data)
    fs.pipe(f"{bucket}/s3fs/small.txt", b"small")
    fs.pipe(f"{bucket}/s3fs/sub/deep.txt", b"deep")
    assert sorted(fs.ls(f"{bucket}/s3fs")) == [f"{bucket}/s3fs/big.bin", f"{bucket}/s3fs/small.txt",
                                                 f"{bucket}/s3fs/sub"]
    assert fs.info(f"{bucket}/s3fs/big.bin")["size"] == len(data)
    assert fs.info(f"{bucket}/s3fs/sub")["type"] == "directory"
    with fs.open(f"{bucket}/s3fs/big.bin", "rb", block_size=1 << 20) as f:
        f.seek(7 << 20)
        assert f.read(1000) == data[7 << 20:(7 << 20) + 1000]
    assert fs.cat(f"{bucket}/s3fs/big.bin") == data
    assert fs.cat_file(f"{bucket}/s3fs/big.bin", start=100, end=200) == data[100:200]
    assert sorted(fs.find(f"{bucket}/s3fs")) == [f"{bucket}/s3fs/big.bin", f"{bucket}/s3fs/small.txt",
                                                   f"{bucket}/s3fs/sub/deep.txt"]
    fs.copy(f"{bucket}/s3fs/small.txt", f"{bucket}/s3fs/copy.txt")
    fs.mv(f"{bucket}/s3fs/copy.txt", f"{bucket}/s3fs/moved.txt")
    assert fs.cat(f"{bucket}/s3fs/moved.txt") == b"small" and not fs.exists(f"{bucket}/s3fs/copy.txt")
    fs.rm(f"{bucket}/s3fs", recursive=True)
    assert not fs.exists(f"{bucket}/s3fs/big.bin")


def test_pyarrow_s3filesystem(gateway, admin_key, bucket):
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    host = gateway.endpoint.removeprefix("http://")
    s3 = pafs.S3FileSystem(access_key=admin_key[0], secret_key=admin_key[1], endpoint_override=host,
                           scheme="http", region="us-east-1")
    table = pa.table({"x": list(range(100_000)), "y": [f"row {i}" for i in range(100_000)]})
    pq.write_table(table, f"{bucket}/pa/t.parquet", filesystem=s3)
    assert pq.read_table(f"{bucket}/pa/t.parquet", filesystem=s3).equals(table)
    with s3.open_output_stream(f"{bucket}/pa/raw.bin") as out:
        for i in range(20):
            out.write(bytes([i]) * (1 << 20))  # 20 MiB: pyarrow uploads it in parts
    info = s3.get_file_info(f"{bucket}/pa/raw.bin")
    assert info.size == 20 << 20
    with s3.open_input_file(f"{bucket}/pa/raw.bin") as f:
        f.seek(5 << 20)
        assert f.read(3) == bytes([5]) * 3
    listing = s3.get_file_info(pafs.FileSelector(f"{bucket}/pa", recursive=True))
    assert sorted(i.path for i in listing) == [f"{bucket}/pa/raw.bin", f"{bucket}/pa/t.parquet"]
    s3.delete_file(f"{bucket}/pa/raw.bin")
    assert s3.get_file_info(f"{bucket}/pa/raw.bin").type == pafs.FileType.NotFound


def _aws(gateway, admin_key, *args, tmp=None, ok=(0,)) -> str:
    aws = shutil.which("aws", path=os.path.dirname(sys.executable))
    if aws is None:
        pytest.skip("the aws CLI (pip awscli) is not installed")
    env = dict(os.environ, AWS_ENDPOINT_URL=gateway.endpoint, AWS_ACCESS_KEY_ID=admin_key[0],
               AWS_SECRET_ACCESS_KEY=admin_key[1], AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    r = subprocess.run([aws, *args], env=env, capture_output=True, text=True, timeout=120, cwd=tmp)
    assert r.returncode in ok, r.stderr
    return r.stdout


def test_aws_cli(gateway, admin_key, bucket, tmp_path, rng):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"aaa")
    (src / "sub" / "big.bin").write_bytes(rng.randbytes(9 << 20))  # multipart (8 MiB parts)
    _aws(gateway, admin_key, "s3", "cp", "--recursive", str(src), f"s3://{bucket}/cli/")
    out = _aws(gateway, admin_key, "s3", "ls", "--recursive", f"s3://{bucket}/cli/")
    assert "cli/a.txt" in out and "cli/sub/big.bin" in out
    _aws(gateway, admin_key, "s3", "cp", "--recursive", f"s3://{bucket}/cli/", str(tmp_path / "dst"))
    assert (tmp_path / "dst" / "sub" / "big.bin").read_bytes() == (src / "sub" / "big.bin").read_bytes()
    _aws(gateway, admin_key, "s3", "rm", "--recursive", f"s3://{bucket}/cli/")
    # `aws s3 ls` exits 1 when it lists nothing
    assert _aws(gateway, admin_key, "s3", "ls", "--recursive", f"s3://{bucket}/cli/", ok=(0, 1)).strip() == ""
