"""GraySort on pond and threefs (issue 21): gensort-1.5 records against an independent per-record
implementation and the published tables, the sort kernels, the two-phase sort on a real cluster at several
sizes (skewed keys, unequal and sampled partitions), valsort naming the first unordered record, a worker
killed mid-phase, a whole job killed mid-phase and resumed, and the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from threefs.pond import graysort as G
from threefs.pond.common import PondError
from threefs.pond.graysort import fileio, records as R
from threefs.pond.graysort.job import MANIFEST, Fault

M128 = (1 << 128) - 1


# ---------------------------------------------------------------------------------------------------------------
# records

def _ref_record(r: int, skew: bool) -> bytes:
    """gensort 1.5's gen_rec / gen_skewed_rec for record r, one record at a time, byte by byte."""
    a, c = R.LCG_A, R.LCG_C
    x = 0
    for _ in range(r + 1):  # only small r here: the plain recurrence, no jumps
        x = (a * x + c) & M128
    rands = []
    for _ in range(10):
        rands.append(x)
        x = (a * x + c) & M128
    rec = bytearray()
    xor = [(0, 0), (0xF0E8E4E2E1D8D4D2, 0xD1CC000000000000), (0xCAC9C6C5C3B8B4B2, 0xB1AC000000000000),
           (0xAAA9A6A5A39C9A99, 0x9695000000000000), (0x938E8D8B87787472, 0x716C000000000000),
           (0x6A696665635C5A59, 0x5655000000000000), (0x534E4D4B473C3A39, 0x3635000000000000),
           (0x332E2D2B271E1D1B, 0x170F000000000000), (0xC8C4C2C198949291, 0x8CE0000000000000),
           (0x170F332E2D2B271E, 0x1D1B000000000000)]
    for v, (xh, xl) in zip(rands, xor):
        hi, lo = (v >> 64) ^ xh, (v & ((1 << 64) - 1)) ^ xl
        rec += hi.to_bytes(8, "big") + (lo >> 48).to_bytes(2, "big")
    if skew:
        index = r.bit_length()
        table = PUBLISHED_SKEW.get(index)
        assert table is not None, f"test covers skew indexes {sorted(PUBLISHED_SKEW)}, not {index}"
        bits = ((rands[0] & ((1 << 64) - 1)) >> 32) & 0x3F
        if bits > 48:
            bits = 0
        i = 0
        while bits >= 8:
            rec[i] = table[i]
            bits -= 8
            i += 1
        if bits > 0:
            mask = 0xFF >> bits
            rec[i] = (table[i] & ~mask & 0xFF) | (rec[i] & mask)
    return bytes(rec)


# entries of gensort 1.5's Skew_binary table, as published in its source
PUBLISHED_SKEW = {0: bytes.fromhex("4a696d477261"), 1: bytes.fromhex("95e0e48262b3"), 2: bytes.fromhex("45979353dbed"),
                  3: bytes.fromhex("882a02c31536"), 4: bytes.fromhex("5c90ab38ae52"), 5: bytes.fromhex("72dc0ca51e33"),
                  6: bytes.fromhex("10431af6a0d8"), 7: bytes.fromhex("5efc4abfaca2"), 8: bytes.fromhex("44f78c8b40bf"),
                  9: bytes.fromhex("84c0992f3b94"), 15: bytes.fromhex("f25bd15439d1"), 64: bytes.fromhex("33d5b5b15c70"),
                  127: bytes.fromhex("98a2542fd23d"), 128: bytes.fromhex("e1dc46b645c4")}


def test_generator_constants_match_published_gensort():
    # rand16.c's table of squared generators: Gen[i] = f^(2^i)
    assert R.jump(1) == (R.LCG_A, R.LCG_C)
    assert R.jump(2) == (0x17bce35bdf69743c529ed9eb20e0ae99, 0x95e0e48262b3edfe04479485c755b646)
    assert R.jump(4) == (0xf4dd417327db7a9bd194dfbe42d45771, 0x882a02c315362b60765f100068b33a1c)
    assert R.jump(1 << 63)[1] == 0x7858ca25feb8d4bf8000000000000000
    table = R.skew_table()
    assert len(table) == 129
    for i, want in PUBLISHED_SKEW.items():
        assert int(table[i]).to_bytes(6, "big") == want, i
    # jumping composes: f^(m+n) = f^m after f^n
    (a1, c1), (a2, c2) = R.jump(12345), R.jump(678)
    assert R.jump(12345 + 678) == ((a1 * a2) & M128, (a1 * c2 + c1) & M128)


@pytest.mark.parametrize("skew", [False, True])
def test_records_match_a_per_record_reference(skew):
    got = R.gensort(0, 300, skew=skew)
    for r in list(range(0, 300, 7)) + [1, 2, 3, 255, 256, 299]:
        assert got[r].tobytes() == _ref_record(r, skew), r
    # the same records from a block that starts elsewhere (the vectorised jump path, small lanes)
    assert (R.gensort(40, 200, skew=skew) == got[40:240]).all()
    hi, top16, _ = R.rand_block(1000, 50, lanes=7)
    for k in range(50):
        v = R.rand_at(1000 + k)
        assert int(hi[k]) == v >> 64 and int(top16[k]) == (v >> 48) & 0xFFFF
    # (record numbers below 512: skew indexes 0..9, all in the published table above)
    assert R.checksum(got) == sum(zlib.crc32(got[i].tobytes()) for i in range(len(got)))


def test_sort_kernels_order_ties_by_all_ten_key_bytes():
    rng = np.random.default_rng(5)
    recs = rng.integers(0, 256, size=(4000, 100), dtype=np.uint8)
    recs[:, :8] = rng.integers(0, 3, size=(4000, 1), dtype=np.uint8)  # 8-byte prefixes: 3 values, many ties
    out = R.sort_records(recs)
    assert R.check_order(out)[0] == -1
    assert sorted(bytes(r) for r in recs) == sorted(bytes(r) for r in out)
    keys = [bytes(r[:10]) for r in out]
    assert keys == sorted(keys)
    grouped, counts = R.partition(recs, np.array([1 << 56, 2 << 56], np.uint64))
    assert counts.tolist() == [int((recs[:, 0] == v).sum()) for v in range(3)]
    assert (grouped[:counts[0], 0] == 0).all() and (grouped[counts[0]:, 0] > 0).all()
    swapped = out.copy()
    swapped[[10, 11]] = swapped[[11, 10]]
    first, _ = R.check_order(swapped)
    assert first in (11, 12) or keys[10] == keys[11]
    dup = out.copy()
    dup[21, :10] = dup[20, :10]
    assert R.check_order(dup)[1] >= 1


# ---------------------------------------------------------------------------------------------------------------
# on a cluster

@pytest.fixture(scope="module")
def tfs(cluster):
    """threefs:// paths of the shared cluster for this module (the client config through the environment)."""
    from threefs.pond.io import filesystem as pfs
    old = os.environ.get("THREEFS_CONFIG")
    os.environ["THREEFS_CONFIG"] = str(cluster.client_config_path)
    pfs.reset_threefs_fs()
    yield cluster
    if old is None:
        os.environ.pop("THREEFS_CONFIG", None)
    else:
        os.environ["THREEFS_CONFIG"] = old
    pfs.reset_threefs_fs()


def _all_records(paths) -> list:
    data = fileio.read_all([(p, 0, fileio.size(p)) for p in paths])
    return [bytes(r) for r in R.as_records(data)]


@pytest.mark.parametrize("records,files,partitions,skew,sample", [
    (1, 1, 1, False, False),
    (7001, 3, 4, False, False),
    (40000, 4, 16, True, False),   # skewed keys by key bits: very unequal partitions
    (40000, 4, 6, True, True),     # sampled split points: even partitions, not a power of 2
])
def test_graysort_sizes(tfs, records, files, partitions, skew, sample):
    root = f"threefs:///gs-{records}-{partitions}-{int(skew)}{int(sample)}"
    m = G.gensort(f"{root}/input", records, files, skew=skew, num_cpus=2)
    assert m.records == records and len(m.files) == files
    rep = G.graysort(f"{root}/input", f"{root}/output", partitions, sample=sample, num_cpus=2)
    v = rep.validation
    assert v.ok, v.summary()
    assert v.records == records and v.checksum == m.checksum_int and v.partitions == partitions
    assert [p.name for p in rep.phases] == ["phase 1 (partition)", "phase 2 (sort)", "valsort"]
    # independent check: the output is the input's records in key order
    out = _all_records(rep.outputs)
    assert sorted(out) == sorted(_all_records(m.files))
    assert [r[:10] for r in out] == sorted(r[:10] for r in out)
    sizes = v.partition_records
    if skew and not sample:
        assert max(sizes) > 3 * max(1, min(sizes)), sizes
    if sample:
        assert max(sizes) < 2 * min(sizes), sizes
    # the job's shuffle files and staging are gone after success (one remove_tree)
    c = fileio.client()
    pond_dir = fileio.strip(f"{root}/pond")
    for job in c.listdir(pond_dir):
        assert sorted(c.listdir(f"{pond_dir}/{job}")) in (["config", "log"], ["log", "config"]), job


def test_killed_workers_are_rerun_and_the_result_is_valid(tfs, tmp_path):
    root = "threefs:///gs-killed"
    m = G.gensort(f"{root}/input", 20000, 4, num_cpus=2, fault=Fault("gensort", 2, str(tmp_path / "g")))
    assert (tmp_path / "g").exists()
    for phase, flag in (("partition", tmp_path / "p"), ("sort", tmp_path / "s")):
        rep = G.graysort(f"{root}/input", f"{root}/output", 8, num_cpus=2, fault=Fault(phase, 1, str(flag)))
        assert flag.exists(), phase
        assert rep.validation.ok and rep.validation.checksum == m.checksum_int, rep.validation.summary()
        st = {p.name.split()[1]: p for p in rep.phases[:2]}
        assert st["1" if phase == "partition" else "2"].retried >= 1


def test_job_killed_mid_phase_resumes_with_a_valid_result(tfs, tmp_path):
    root = "threefs:///gs-resume"
    m = G.gensort(f"{root}/input", 30000, 4, num_cpus=2)
    flag = tmp_path / "driver-killed"
    script = textwrap.dedent(f"""
        import os
        from threefs.pond import graysort as G
        from threefs.pond.graysort.job import Fault
        G.graysort({root + '/input'!r}, {root + '/output'!r}, 8, job_id="resume-me", num_cpus=1,
                   fault=Fault("sort", 5, {str(flag)!r}, kill_pid=os.getpid()))
        print("NOT KILLED")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "THREEFS_CONFIG": str(tfs.client_config_path)},
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the killed driver's orphaned pool workers
        except ProcessLookupError:
            pass
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, out, err[-2000:])
    assert flag.exists() and b"NOT KILLED" not in out
    # phase 2's task 5 died half-way through its temporary file; the real output names are only complete files
    outs = fileio.listdir(f"{root}/output")
    assert "part-00005.dat" not in outs and any(n.startswith("part-00005.dat.") for n in outs)
    rep = G.graysort(f"{root}/input", f"{root}/output", 8, job_id="resume-me", num_cpus=2)
    p1, p2 = rep.phases[0], rep.phases[1]
    assert p1.resumed == 4 and p1.executed == 0          # every phase-1 producer had finished
    assert p2.resumed >= 1 and p2.executed >= 1 and p2.resumed + p2.executed == 8
    assert rep.validation.ok and rep.validation.checksum == m.checksum_int, rep.validation.summary()


def test_valsort_names_the_first_unordered_record(tmp_path):
    base = str(tmp_path)
    m = G.gensort(f"{base}/input", 3000, 2, num_cpus=1)
    recs = R.sort_records(R.as_records(fileio.read_all([(f, 0, fileio.size(f)) for f in m.files])))
    os.makedirs(f"{base}/out")

    def write(parts):
        for name in os.listdir(f"{base}/out"):
            os.remove(f"{base}/out/{name}")
        for i, p in enumerate(parts):
            with open(f"{base}/out/part-{i:05d}.dat", "wb") as f:
                f.write(p.tobytes())

    write([recs[:1000], recs[1000:2000], recs[2000:]])
    v = G.valsort(f"{base}/out", input_dir=f"{base}/input", num_cpus=1)
    assert v.ok and v.records == 3000 and v.checksum == m.checksum_int and v.first_unordered is None
    swapped = recs.copy()
    swapped[[1500, 1501]] = swapped[[1501, 1500]]
    write([swapped[:1000], swapped[1000:2000], swapped[2000:]])
    v = G.valsort(f"{base}/out", input_dir=f"{base}/input", num_cpus=1)
    assert not v.ok and v.first_unordered == 1501 and "partition 1" in v.first_unordered_where
    assert v.checksum == m.checksum_int  # same records, wrong order
    write([recs[1000:2000], recs[:1000], recs[2000:2999]])  # partitions swapped, one record lost
    v = G.valsort(f"{base}/out", input_dir=f"{base}/input", num_cpus=1)
    assert v.first_unordered == 1000 and "partition 1" in v.first_unordered_where
    assert any("2999 records in the output, 3000 in the input" in p for p in v.problems)
    assert any("checksum" in p for p in v.problems)
    assert "FAILURE" in v.summary()


def test_bad_input_is_refused_with_a_message(tmp_path):
    base = str(tmp_path)
    G.gensort(f"{base}/input", 100, 1, num_cpus=1)
    with pytest.raises(PondError, match="power of 2"):
        G.graysort(f"{base}/input", f"{base}/out", 6, num_cpus=1)
    os.makedirs(f"{base}/raw")
    with open(f"{base}/raw/x.dat", "wb") as f:
        f.write(b"x" * 150)
    with pytest.raises(PondError, match="not a whole number of 100-byte records"):
        G.graysort(f"{base}/raw", f"{base}/out", 2, num_cpus=1)
    os.makedirs(f"{base}/empty")
    with pytest.raises(PondError, match="no .*dat record files"):
        G.graysort(f"{base}/empty", f"{base}/out", 2, num_cpus=1)
    assert os.path.exists(f"{base}/input/{MANIFEST}")


def test_cli_graysort(tfs, capsys):
    from threefs.cli.main import main
    rc = main(["--config", str(tfs.client_config_path), "pond", "graysort", "--gib", "0.002", "--partitions", "4",
               "--root", "threefs:///gs-cli", "--no-progress", "--keep"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "gensort:" in out and "phase 1 (partition):" in out and "phase 2 (sort):" in out
    assert "GB/min" in out and "SUCCESS" in out
    rc = main(["--config", str(tfs.client_config_path), "pond", "valsort", "threefs:///gs-cli/output",
               "--input", "threefs:///gs-cli/input", "--no-progress"])
    assert rc == 0 and "SUCCESS" in capsys.readouterr().out
    rc = main(["--config", str(tfs.client_config_path), "pond", "graysort", "--gib", "0.002", "--partitions", "3",
               "--root", "threefs:///gs-cli", "--no-progress"])
    assert rc == 1 and "power of 2" in capsys.readouterr().err
