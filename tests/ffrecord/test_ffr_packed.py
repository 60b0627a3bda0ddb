"""Packed folders (ours and the reference's pickle index, read safely) and dump(); local files."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict

import pytest

from threefs.cli.main import main
from threefs.common.status import StatusCode, ThreeFSError
from threefs.ffrecord import FileReader, FileWriter
from threefs.ffrecord.dump import dump
from threefs.ffrecord.packed import REFERENCE_MAGIC, PackedFolder, pack_folder


def make_tree(root, rng_seed: int = 7) -> dict[str, bytes]:
    import random

    rng = random.Random(rng_seed)
    files = {}
    for rel in ("b.txt", "a/x.bin", "a/y.bin", "a/deep/z", "c/empty", "a/deep/w"):
        data = b"" if rel.endswith("empty") else rng.randbytes(rng.randrange(1, 5000))
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        files[rel] = data
    return files


@pytest.mark.parametrize("reference", [False, True])
def test_pack_folder_round_trip(tmp_path, reference):
    files = make_tree(tmp_path / "src")
    out = tmp_path / "out.ffr"
    seen = []
    assert pack_folder(tmp_path / "src", out, reference=reference, progress=seen.append) == len(files)
    assert sum(seen) == sum(map(len, files.values()))
    with PackedFolder(out) as pf:
        assert pf.reader.version_of(0) == (1 if reference else 2)
        assert pf.num_files() == len(files)
        assert pf.list() == ["a", "b.txt", "c"]  # sorted, depth first: the reference's order
        assert pf.list("a", recursive=True) == ["deep", "deep/w", "deep/z", "x.bin", "y.bin"]
        assert pf.list("a", list_dir=False) == ["x.bin", "y.bin"]
        assert pf.read_one("a/deep/z").tobytes() == files["a/deep/z"]
        names = sorted(files)
        assert [a.tobytes() for a in pf.read(names)] == [files[n] for n in names]
        assert pf.is_dir("a/deep") and pf.is_file("b.txt") and not pf.exists("nope")
        with pytest.raises(FileNotFoundError, match="no such file"):
            pf.read_one("a/nope")
        with pytest.raises(IsADirectoryError):
            pf.read_one("a")
        with pytest.raises(ThreeFSError, match="is a file"):
            pf.list("b.txt")
    # the sample order is the reference's: sorted depth-first, the index last
    with FileReader(out) as r:
        assert r.read_one(0).tobytes() == files["a/deep/w"]


def test_reference_pickle_index_is_parsed_without_running_code(tmp_path):
    # the reference's pack_folder output: files, then b"piouhjgbr" + pickle(OrderedDict tree)
    tree = OrderedDict([("d", OrderedDict([("f", 0)])), ("g", 1)])
    path = tmp_path / "ref.ffr"
    with FileWriter(path, 3, version=1) as w:
        for s in (b"F", b"G", REFERENCE_MAGIC + pickle.dumps(tree)):
            w.write_one(s)
    with PackedFolder(path) as pf:
        assert pf.read(["d/f", "g"])[1].tobytes() == b"G"

    class Evil:
        def __reduce__(self):
            return (os.getpid, ())  # would be called by a plain pickle.loads

    bad = tmp_path / "evil.ffr"
    with FileWriter(bad, 2, version=1) as w:
        w.write_one(b"x")
        w.write_one(REFERENCE_MAGIC + pickle.dumps(OrderedDict([("x", Evil())])))
    with pytest.raises(ThreeFSError, match="posix.getpid.*only OrderedDict") as e:
        PackedFolder(bad)
    assert e.value.code == StatusCode.NOT_SUPPORTED
    # a tree pointing outside the files is refused too
    with FileWriter(tmp_path / "oob.ffr", 2, version=1) as w:
        w.write_one(b"x")
        w.write_one(REFERENCE_MAGIC + pickle.dumps(OrderedDict([("x", 5)])))
    with pytest.raises(ThreeFSError, match="not a sample"):
        PackedFolder(tmp_path / "oob.ffr")
    with FileWriter(tmp_path / "plain.ffr", 1) as w:
        w.write_one(b"just data")
    with pytest.raises(ThreeFSError, match="not a packed folder"):
        PackedFolder(tmp_path / "plain.ffr")


def test_pack_refuses_special_files(tmp_path):
    make_tree(tmp_path / "src")
    os.symlink(tmp_path / "missing", tmp_path / "src" / "dangling")
    with pytest.raises(ThreeFSError, match="dangling"):
        pack_folder(tmp_path / "src", tmp_path / "o.ffr")
    assert not os.path.exists(tmp_path / "o.ffr")


def test_dump_splits_like_the_reference(tmp_path):
    data = [bytes([i]) * i for i in range(10)]
    names = dump(data, tmp_path / "ds", 3)
    assert [os.path.basename(n) for n in names] == ["PART_00000.ffr", "PART_00001.ffr", "PART_00002.ffr"]
    with FileReader(tmp_path / "ds") as r:
        assert [len(r.get_offsets(k)) - 1 for k in range(3)] == [4, 4, 2]
        assert [a.tobytes() for a in r.read(range(10))] == data
    one = dump(data, tmp_path / "one.ffr", 1, encode=lambda b: b[::-1], version=1)
    with FileReader(one[0]) as r:
        assert r.read_one(3).tobytes() == data[3][::-1] and r.version_of(0) == 1
    with pytest.raises(ThreeFSError, match="item 0 is a dict"):
        dump([{"a": 1}], tmp_path / "bad.ffr", 1)
    with pytest.raises(ThreeFSError, match="nfiles"):
        dump(data, tmp_path / "x", 0)


def test_cli_pack_ls_info_validate_local(tmp_path, capsys):
    files = make_tree(tmp_path / "src")
    out = str(tmp_path / "p.ffr")
    assert main(["ffrecord", "pack", "--local", "-q", str(tmp_path / "src"), out]) == 0
    assert main(["ffrecord", "ls", "--local", "-r", out, "a"]) == 0
    assert capsys.readouterr().out.split() == ["deep/", "deep/w", "deep/z", "x.bin", "y.bin"]
    assert main(["ffrecord", "info", "--local", out]) == 0
    assert f"{len(files) + 1} samples" in capsys.readouterr().out
    assert main(["ffrecord", "validate", "--local", "-q", out]) == 0
    assert "every checksum matches" in capsys.readouterr().out
    raw = bytearray(open(out, "rb").read())
    raw[-3] ^= 1  # inside the index, the last sample
    open(out, "wb").write(raw)
    assert main(["ffrecord", "validate", "--local", "-q", out]) == 1
    assert "CHECKSUM_MISMATCH" in capsys.readouterr().err
    assert main(["ffrecord", "pack", "--local", str(tmp_path / "nope"), out]) == 1
    assert "is not a local folder" in capsys.readouterr().err
