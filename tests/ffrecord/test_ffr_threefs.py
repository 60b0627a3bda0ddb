"""FFRecord files on threefs: written through the client, read with one batch_read per call, the
same bytes as a local copy, pickled readers, the CLI against the shared cluster."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import numpy as np
import pytest

from threefs.cli.main import main
from threefs.common.status import StatusCode, ThreeFSError
from threefs.ffrecord import FileReader, FileWriter
from threefs.ffrecord.dump import dump
from threefs.ffrecord.packed import PackedFolder, pack_folder


def write(fs, path, samples, version=2):
    with FileWriter(path, len(samples), client=fs, version=version) as w:
        for s in samples:
            w.write_one(s)


@pytest.mark.parametrize("version", [1, 2])
def test_write_and_read_random_batches(fs, d, samples, tmp_path, version):
    write(fs, f"{d}/a.ffr", samples, version)
    assert fs.listdir(d) == ["a.ffr"]  # the temporary file is gone
    write(None, tmp_path / "a.ffr", samples, version)  # the same on local disk
    assert fs.read_bytes(f"{d}/a.ffr") == (tmp_path / "a.ffr").read_bytes()
    with FileReader(f"{d}/a.ffr", client=fs) as r:
        rng = np.random.default_rng(1)
        for _ in range(5):
            idx = rng.integers(0, len(samples), 64)
            assert [a.tobytes() for a in r.read(idx)] == [samples[i] for i in idx]
        r.validate()
        with pytest.raises(IndexError):
            r.read([len(samples)])


def test_one_batch_read_per_call_across_files(fs, d, samples, monkeypatch):
    dump(samples, f"{d}/ds", 4, client=fs)
    calls = []
    real = fs.read_columns

    def counting(attrs, file_of, *args, **kw):
        calls.append((len(attrs), len(file_of)))
        return real(attrs, file_of, *args, **kw)

    with FileReader(f"{d}/ds", client=fs) as r:
        assert r.n == len(samples) and len(r.fnames) == 4
        monkeypatch.setattr(fs, "read_columns", counting)
        idx = [0, 299, 150, 77, 78, 79, 200, 5]
        assert [a.tobytes() for a in r.read(idx)] == [samples[i] for i in idx]
    # one call naming the 4 files read; 77..79 are adjacent in one file and go as one IO, the empty
    # sample 5 needs none
    assert calls == [(4, 5)]


def test_corruption_on_storage_names_the_sample(fs, d, samples):
    write(fs, f"{d}/c.ffr", samples)
    with FileReader(f"{d}/c.ffr", client=fs) as r:
        offset = int(r.get_offsets(0)[42])
    fs.batch_write([(f"{d}/c.ffr", offset, bytes([samples[42][0] ^ 0xFF]))])
    with FileReader(f"{d}/c.ffr", client=fs) as r:
        with pytest.raises(ThreeFSError, match=r"sample 42 \(sample 42 of /.*/c.ffr") as e:
            r.read([41, 42])
        assert e.value.code == StatusCode.CHECKSUM_MISMATCH


def test_aborted_writer_leaves_nothing_and_truncated_file_is_refused(fs, d, samples):
    with pytest.raises(RuntimeError):
        with FileWriter(f"{d}/x.ffr", 10, client=fs) as w:
            w.write_one(samples[0])
            raise RuntimeError("crash")
    assert fs.listdir(d) == []
    write(fs, f"{d}/t.ffr", samples)
    fs.truncate(f"{d}/t.ffr", fs.stat(f"{d}/t.ffr").length - 10)
    with pytest.raises(ThreeFSError, match="truncated"):
        FileReader(f"{d}/t.ffr", client=fs)


def _spawned_read(blob, idx, q):
    try:
        r = pickle.loads(blob)
        q.put([a.tobytes() for a in r.read(idx)])
    except BaseException as e:  # report, never hang the parent
        q.put(repr(e))


def test_reader_pickles_and_reconnects_in_a_spawned_process(fs, d, samples):
    write(fs, f"{d}/p.ffr", samples)
    with FileReader(f"{d}/p.ffr", client=fs, check_data=False) as r:
        blob = pickle.dumps(r)
    same = pickle.loads(blob)  # in this process: a shared client for the config
    assert same.check_data is False and same.read_one(3).tobytes() == samples[3]
    same.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_spawned_read, args=(blob, [9, 1, 299], q))
    p.start()
    try:
        assert q.get(timeout=120) == [samples[i] for i in (9, 1, 299)]
    finally:
        p.join(60)
    assert p.exitcode == 0


def test_packed_folder_on_threefs_and_cli(fs, d, cluster, tmp_path, capsys):
    (tmp_path / "src" / "k").mkdir(parents=True)
    for i in range(20):
        (tmp_path / "src" / "k" / f"{i:02d}.jpg").write_bytes(bytes([i]) * (i * 100))
    assert pack_folder(tmp_path / "src", f"{d}/pack.ffr", client=fs) == 20
    with PackedFolder(f"{d}/pack.ffr", client=fs) as pf:
        assert pf.read(["k/07.jpg", "k/19.jpg"])[1].tobytes() == bytes([19]) * 1900
    cfg = str(cluster.client_config_path)
    assert main(["--config", cfg, "ffrecord", "pack", "-q", str(tmp_path / "src"), f"{d}/cli.ffr"]) == 0
    assert fs.read_bytes(f"{d}/cli.ffr") == fs.read_bytes(f"{d}/pack.ffr")
    assert main(["--config", cfg, "ffrecord", "validate", "-q", f"{d}/cli.ffr"]) == 0
    assert main(["--config", cfg, "ffrecord", "info", "--json", f"{d}/cli.ffr"]) == 0
    assert '"samples": 21' in capsys.readouterr().out
    assert main(["--config", cfg, "ffrecord", "ls", f"{d}/cli.ffr", "k"]) == 0
    assert capsys.readouterr().out.split()[:2] == ["00.jpg", "01.jpg"]
    assert main(["--config", cfg, "ffrecord", "info", f"{d}/missing.ffr"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_local_path_api_reads_through_the_fuse_mount(fs, d, samples, fuse_mnt):
    from threefs.ffrecord.backend import IO_THREADS_FUSE, fs_type

    write(fs, f"{d}/m.ffr", samples, version=1)
    path = fuse_mnt + f"{d}/m.ffr"
    assert fs_type(path).startswith("fuse")
    idx = np.random.default_rng(5).integers(0, len(samples), 200)
    with FileReader(path) as r:  # no client: OS reads, several in flight on a FUSE file
        assert r._files.io_threads == IO_THREADS_FUSE
        assert [a.tobytes() for a in r.read(idx)] == [samples[i] for i in idx]
    with FileReader(path, io_threads=0) as r:
        assert [a.tobytes() for a in r.read(idx)] == [samples[i] for i in idx]
    with pytest.raises(ThreeFSError, match="io_threads"):
        FileReader(path, io_threads=-1)
