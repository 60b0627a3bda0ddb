"""FFRecord layout compatibility, built from the published layout (HFAiLab ffrecord v1.4.0 writer.cpp)
with struct, independent of threefs.ffrecord.format; torn files, corruption and bad input. Local files
only (no cluster)."""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.ffrecord import MAGIC, FileReader, FileWriter


def spec_v1(samples: list[bytes], legacy: bool = False) -> bytes:
    """A v1 file exactly as the reference writer lays it out (little-endian, no padding)."""
    n = len(samples)
    checksums = [zlib.crc32(s, 0) for s in samples]
    offsets, pos = [], 4 + 8 + 12 * n
    for s in samples:
        offsets.append(pos)
        pos += len(s)
    meta = struct.pack("<q", n) + struct.pack(f"<{n}I", *checksums) + struct.pack(f"<{n}q", *offsets)
    crc = 0 if legacy else zlib.crc32(meta, 0)
    return struct.pack("<I", crc) + meta + b"".join(samples)


def write_ours(path, samples, version):
    with FileWriter(path, len(samples), version=version) as w:
        for s in samples:
            w.write_one(s)


def test_spec_built_v1_file_reads_back(tmp_path, samples):
    path = tmp_path / "spec.ffr"
    path.write_bytes(spec_v1(samples))
    with FileReader(path) as r:
        assert r.n == len(samples) and r.version_of(0) == 1
        order = list(range(len(samples)))[::-7] + [3, 3, 5, 6]
        assert [a.tobytes() for a in r.read(order)] == [samples[i] for i in order]
        assert r.read_one(299).tobytes() == samples[299]
        assert r.get_offsets(0)[-1] == path.stat().st_size
        assert r.get_checksums(0).tolist() == [zlib.crc32(s) for s in samples]
        r.validate()


def test_our_v1_file_is_the_spec_byte_for_byte(tmp_path, samples):
    write_ours(tmp_path / "ours.ffr", samples, version=1)
    raw = (tmp_path / "ours.ffr").read_bytes()
    assert raw == spec_v1(samples)
    # and parsed per the spec: meta CRC over [4, 12+12N), per-sample CRC, offsets
    crc, n = struct.unpack_from("<Iq", raw)
    assert n == len(samples) and crc == zlib.crc32(raw[4:12 + 12 * n])
    offsets = list(struct.unpack_from(f"<{n}q", raw, 12 + 4 * n)) + [len(raw)]
    sums = struct.unpack_from(f"<{n}I", raw, 12)
    for i in range(n):
        assert zlib.crc32(raw[offsets[i]:offsets[i + 1]]) == sums[i]


def test_our_v2_file_matches_its_documented_layout(tmp_path, samples):
    write_ours(tmp_path / "v2.ffr", samples, version=2)
    raw = (tmp_path / "v2.ffr").read_bytes()
    magic, version, crc, n, size = struct.unpack_from("<8sIIqq", raw)
    assert (magic, version, n, size) == (MAGIC, 2, len(samples), len(raw))
    start = 32 + 12 * n
    assert crc == zlib.crc32(raw[16:start])
    offsets = list(struct.unpack_from(f"<{n}q", raw, 32 + 4 * n)) + [len(raw)]
    assert offsets[0] == start
    assert [raw[offsets[i]:offsets[i + 1]] for i in range(n)] == samples


def test_legacy_file_without_header_crc_reads_with_a_warning(tmp_path, samples):
    path = tmp_path / "old.ffr"
    path.write_bytes(spec_v1(samples[:10], legacy=True))
    with pytest.warns(UserWarning, match="without a header checksum"):
        r = FileReader(path)
    assert [a.tobytes() for a in r.read(range(10))] == samples[:10]


def test_directory_of_files_has_global_indices(tmp_path, samples):
    parts = [samples[:100], samples[100:101], samples[101:]]
    for k, part in enumerate(parts):
        write_ours(tmp_path / f"PART_{k:05d}.ffr", part, version=1 + k % 2)
    (tmp_path / "notes.txt").write_text("not a sample file")
    with FileReader(tmp_path) as r:
        assert r.n == len(samples) and [os.path.basename(f) for f in r.fnames] == \
            ["PART_00000.ffr", "PART_00001.ffr", "PART_00002.ffr"]
        idx = np.random.default_rng(3).integers(0, len(samples), 500)
        assert [a.tobytes() for a in r.read(idx)] == [samples[i] for i in idx]
        assert [a.tobytes() for a in r.read([99, 100, 101])] == samples[99:102]


@pytest.mark.parametrize("version", [1, 2])
def test_checksum_failure_names_the_sample(tmp_path, samples, version):
    path = tmp_path / "bad.ffr"
    write_ours(path, samples, version)
    with FileReader(path) as r:
        offset = int(r.get_offsets(0)[7])
    raw = bytearray(path.read_bytes())
    raw[offset + 1] ^= 0xFF
    path.write_bytes(raw)
    with FileReader(path) as r:
        with pytest.raises(ThreeFSError, match=r"sample 7 \(") as e:
            r.read([1, 7, 9])
        assert e.value.code == StatusCode.CHECKSUM_MISMATCH
        assert r.read([1, 9])[0].tobytes() == samples[1]  # the others stay readable
        with pytest.raises(ThreeFSError, match="sample 7 "):
            r.validate()
    with FileReader(path, check_data=False) as r:
        assert r.read_one(7).tobytes() != samples[7]


@pytest.mark.parametrize("version", [1, 2])
def test_corrupt_header_is_refused(tmp_path, samples, version):
    path = tmp_path / "hdr.ffr"
    write_ours(path, samples, version)
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0x01  # inside the checksum table of both layouts
    path.write_bytes(raw)
    with pytest.raises(ThreeFSError, match="header checksum mismatch") as e:
        FileReader(path)
    assert e.value.code == StatusCode.CHECKSUM_MISMATCH


def test_torn_files_are_refused_not_read_as_empty(tmp_path, samples):
    # what a crashed reference writer leaves: zero header, samples after it
    torn = tmp_path / "torn.ffr"
    torn.write_bytes(bytes(12 + 12 * 10) + b"".join(samples[:10]))
    with pytest.raises(ThreeFSError, match="torn FFRecord file"):
        FileReader(torn)
    # a v2 file cut short (a copy that stopped) or with bytes appended
    write_ours(tmp_path / "v2.ffr", samples, 2)
    raw = (tmp_path / "v2.ffr").read_bytes()
    (tmp_path / "cut.ffr").write_bytes(raw[:-1])
    with pytest.raises(ThreeFSError, match="truncated"):
        FileReader(tmp_path / "cut.ffr")
    (tmp_path / "long.ffr").write_bytes(raw + b"x")
    with pytest.raises(ThreeFSError, match="trailing bytes"):
        FileReader(tmp_path / "long.ffr")
    (tmp_path / "tiny.ffr").write_bytes(b"abc")
    with pytest.raises(ThreeFSError, match="too short"):
        FileReader(tmp_path / "tiny.ffr")
    # a v1 header claiming more samples than fit
    (tmp_path / "lies.ffr").write_bytes(struct.pack("<Iq", 1, 10**6) + b"x" * 100)
    with pytest.raises(ThreeFSError, match="does not fit"):
        FileReader(tmp_path / "lies.ffr")


def test_unfinished_writer_publishes_nothing(tmp_path, samples):
    path = tmp_path / "w.ffr"
    with pytest.raises(RuntimeError):
        with FileWriter(path, 10) as w:
            w.write_one(samples[0])
            raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path) == []  # neither the file nor its temporary sibling
    w = FileWriter(path, 3)
    w.write_one(b"a")
    with pytest.raises(ThreeFSError, match="wrote 1 samples but the writer was opened for 3"):
        w.close()
    assert os.listdir(tmp_path) == []
    # a half-written temporary file is never mistaken for a dataset
    w = FileWriter(path, 2)
    w.write_one(b"abc")
    w._f.flush()
    [tmp] = os.listdir(tmp_path)
    assert not tmp.endswith(".ffr")
    with pytest.raises(ThreeFSError, match="torn"):
        FileReader(tmp_path / tmp)
    w.abort()
    assert os.listdir(tmp_path) == []


def test_bad_input_gets_clear_errors(tmp_path, samples):
    with pytest.raises(ThreeFSError, match="end in .ffr"):
        FileWriter(tmp_path / "x.bin", 1)
    with pytest.raises(ThreeFSError, match="sample count"):
        FileWriter(tmp_path / "x.ffr", -1)
    with pytest.raises(ThreeFSError, match="version"):
        FileWriter(tmp_path / "x.ffr", 1, version=3)
    with FileWriter(tmp_path / "x.ffr", 2) as w:
        with pytest.raises(ThreeFSError, match="is a str"):
            w.write_one("text")
        with pytest.raises(ThreeFSError, match="not a bytes-like"):
            w.write_one({"a": 1})
        with pytest.raises(ThreeFSError, match="not contiguous"):
            w.write_one(np.arange(10, dtype=np.uint8)[::2])
        w.write_one(np.arange(4, dtype=np.int32))  # any contiguous buffer, as its bytes
        w.write_one(memoryview(b"xy"))
        with pytest.raises(ThreeFSError, match="all 2 samples"):
            w.write_one(b"z")
    with FileReader(tmp_path / "x.ffr") as r:
        assert r.read_one(0).tobytes() == np.arange(4, dtype=np.int32).tobytes()
        for bad in (-1, 2, 10**12):
            with pytest.raises(IndexError, match="out of range"):
                r.read([0, bad])
        with pytest.raises(IndexError):
            r.read_one(-1)  # the reference reads out of bounds here
        with pytest.raises(ThreeFSError, match="flat list of ints"):
            r.read([0.5])
        with pytest.raises(ThreeFSError, match="must be an int"):
            r.read_one("0")
        assert r.read([]) == []
    with pytest.raises(FileNotFoundError):
        FileReader(tmp_path / "missing.ffr")
    os.mkdir(tmp_path / "empty")
    with pytest.raises(ThreeFSError, match="no .ffr files"):
        FileReader(tmp_path / "empty")
    with pytest.raises(ThreeFSError, match="closed"):
        r.read([0])


def test_adjacent_samples_coalesce_and_results_are_independent(tmp_path, samples):
    write_ours(tmp_path / "c.ffr", samples, 2)
    with FileReader(tmp_path / "c.ffr") as r:
        out = r.read([10, 11, 12, 11, 40, 13])
        assert [a.tobytes() for a in out] == [samples[i] for i in (10, 11, 12, 11, 40, 13)]
        out[1][:] = 0  # a repeated index is its own copy
        assert out[3].tobytes() == samples[11]


def test_file_truncated_while_open_names_the_sample(tmp_path, samples):
    path = tmp_path / "t.ffr"
    write_ours(path, samples, 1)
    with FileReader(path) as r:
        os.truncate(path, int(r.get_offsets(0)[-2]) + 1)  # cut inside the last sample
        assert r.read_one(0).tobytes() == samples[0]
        with pytest.raises(ThreeFSError, match=r"reading sample 299 of .*t.ffr at offset \d+ \(\d+ bytes\): "
                                               r"read 1 of") as e:
            r.read([0, 299])
        assert e.value.code == StatusCode.IO_ERROR


def test_local_reader_pickles_to_its_paths(tmp_path, samples):
    import pickle

    write_ours(tmp_path / "p.ffr", samples, 2)
    with FileReader(tmp_path / "p.ffr", check_data=False, io_threads=2) as r:
        clone = pickle.loads(pickle.dumps(r))
    with clone:
        assert clone.fnames == [str(tmp_path / "p.ffr")] and clone.check_data is False
        assert clone._files.io_threads == 2
        assert [a.tobytes() for a in clone.read([4, 1, 4])] == [samples[i] for i in (4, 1, 4)]


def test_sample_crc_is_zlibs_crc32():
    """The reader and writer check samples with format.crc32 (ISA-L's when installed): it must be the
    reference's zlib.crc32 on every length and alignment, or files would not interoperate."""
    from threefs.ffrecord import format as fmt

    rng = np.random.default_rng(20261204)
    data = rng.integers(0, 256, 300_000, dtype=np.uint8)
    for length in [0, 1, 3, 15, 16, 17, 63, 64, 1023, 1024, 4097, 65536, 262_143]:
        start = int(rng.integers(0, 64))
        view = data[start:start + length]
        assert fmt.crc32(view) == zlib.crc32(view), length
