"""pond on threefs: input, shuffle files, staging and outputs on the FUSE mount of a local cluster; inputs read
as threefs:// through fsspec (no mount); a job's temporaries removed with one recursive remove."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

import threefs.pond as pond
from threefs.client import fuse_mount

from pond_helpers import multiset, reference


@pytest.fixture(scope="module")
def mount(cluster):
    reason = fuse_mount.fuse_unavailable_reason()
    if reason:
        pytest.skip(f"FUSE unavailable: {reason}")
    top = tempfile.mkdtemp(prefix="pond-fuse-")
    mnt = os.path.join(top, "mnt")
    proc = fuse_mount.spawn(str(cluster.client_config_path), mnt, [], os.path.join(top, "fuse.log"))
    yield mnt
    fuse_mount.stop(proc, mnt)
    shutil.rmtree(top, ignore_errors=True)


def test_job_on_the_mount(mount, data_dir):
    base = os.path.join(mount, "pond-mount")
    shutil.copytree(data_dir, os.path.join(base, "data"), dirs_exist_ok=True)
    sp = pond.init(data_root=os.path.join(base, "root"), num_cpus=2, progress=False)
    try:
        df = sp.read_parquet(os.path.join(base, "data", "*.parquet")).repartition(4, hash_by="k")
        out = sp.partial_sql("select k, count(*) as n, sum(v) as t from {0} group by k", df)
        out.write_parquet(os.path.join(base, "out"))
        assert multiset(out.to_pandas().itertuples(index=False)) == \
            reference(data_dir, "select k, count(*), sum(v) from {0} group by k")
        files = [f for f in os.listdir(os.path.join(base, "out")) if f.endswith(".parquet")]
        assert files and all(os.stat(os.path.join(base, "out", f)).st_nlink >= 2 for f in files)
        staging = sp._runtime_ctx.staging_root
        assert os.path.isdir(staging)
    finally:
        sp.shutdown()
    assert not os.path.exists(staging)


def test_threefs_url_inputs_and_data_root(cluster, fs, data_dir, monkeypatch):
    monkeypatch.setenv("THREEFS_CONFIG", str(cluster.client_config_path))
    fs.mkdir("/pond-url/data", parents=True, exist_ok=True)
    for name in sorted(os.listdir(data_dir)):
        if name.endswith(".parquet"):
            fs.put(os.path.join(data_dir, name), f"/pond-url/data/{name}")
    from threefs.pond.io import filesystem as pfs
    pfs.reset_threefs_fs()
    sp = pond.init(data_root="threefs:///pond-url/root", num_cpus=2, progress=False)
    try:
        df = sp.read_parquet("threefs:///pond-url/data/*.parquet")
        assert df.count() == 6000
        out = sp.partial_sql("select k, count(*) from {0} group by k", df.repartition(3, hash_by="k"))
        assert multiset(out.take_all()) == reference(data_dir, "select k, count(*) from {0} group by k")
        assert multiset(df.repartition(2, by_rows=True).partial_sort("id").take_all()) == \
            reference(data_dir, "select * from {0}")
        staging = sp._runtime_ctx.staging_root
        assert fs.exists(staging[len("threefs://"):])
    finally:
        sp.shutdown()
    assert not fs.exists(staging[len("threefs://"):])  # one remove_tree call


def test_threefs_url_with_bulk_data_through_the_mount(cluster, fs, mount, data_dir, monkeypatch):
    monkeypatch.setenv("THREEFS_CONFIG", str(cluster.client_config_path))
    fs.mkdir("/pond-both/data", parents=True, exist_ok=True)
    for name in sorted(os.listdir(data_dir)):
        if name.endswith(".parquet"):
            fs.put(os.path.join(data_dir, name), f"/pond-both/data/{name}")
    with pytest.raises(pond.PondError, match="is not a mounted threefs file system"):
        pond.init(data_root="threefs:///pond-both/root", threefs_mount=data_dir, progress=False)
    sp = pond.init(data_root="threefs:///pond-both/root", threefs_mount=mount, num_cpus=2, progress=False)
    try:
        df = sp.read_parquet("threefs:///pond-both/data/*.parquet").repartition(3, hash_by="k")
        out = sp.partial_sql("select k, count(*) from {0} group by k", df)
        assert multiset(out.take_all()) == reference(data_dir, "select k, count(*) from {0} group by k")
        with pytest.raises(pond.PondError) as info:
            sp.partial_sql("select no_such_column from {0}", df).count()
        assert f"read_parquet(['{mount}/pond-both/root/" in str(info.value)  # DuckDB read through the mount
    finally:
        sp.shutdown()
    # the deliberate error failed the job: its files stay for a rerun (the test above covers the cleanup)
    assert fs.exists("/pond-both/root/" + os.path.basename(sp._runtime_ctx.job_root) + "/staging")


def test_configuring_another_cluster_closes_the_old_client(cluster):
    """configure() to another client config (and reset_threefs_fs) closes the client of the file system it
    drops: none is left running its loop thread to the end of the process."""
    from threefs.pond.io import filesystem as pfs
    before = pfs._config[0]
    path = str(cluster.client_config_path)
    try:
        pfs.configure(path)
        old = pfs.threefs_fs().client
        assert old.exists("/")
        pfs.configure(os.path.join(os.path.dirname(path), ".", os.path.basename(path)))  # another config string
        assert old._loop is None  # closed
        new = pfs.threefs_fs().client
        assert new is not old and new.exists("/")
        pfs.reset_threefs_fs()
        assert new._loop is None
    finally:
        pfs._config[0] = before
        pfs.reset_threefs_fs()
