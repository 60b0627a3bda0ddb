"""Big FFRecord batches on threefs: samples checked on several threads (over 1 MiB a batch) still name the
damaged sample, and DataLoader-sized batches read back exactly what was written."""

from __future__ import annotations

import random

import numpy as np
import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.ffrecord import FileReader, FileWriter
from threefs.ffrecord import reader as reader_mod


@pytest.fixture
def big_samples():
    rng = random.Random(15)
    return [rng.randbytes(rng.choice([40_000, 65_536, 70_000])) for _ in range(96)]


def test_big_batches_read_exactly_and_name_a_damaged_sample(fs, d, big_samples):
    path = f"{d}/big.ffr"
    with FileWriter(path, len(big_samples), client=fs) as w:
        for s in big_samples:
            w.write_one(s)
    rng = np.random.default_rng(3)
    with FileReader(path, client=fs) as r:
        for _ in range(5):
            idx = rng.integers(0, len(big_samples), 64)
            assert sum(len(big_samples[i]) for i in idx) >= reader_mod.CRC_PARALLEL_BYTES_MIN  # the threaded check
            got = r.read(idx)
            assert [g.tobytes() for g in got] == [big_samples[i] for i in idx]
        offset = int(r.get_offsets(0)[77]) + 1000
    fs.batch_write([(path, offset, bytes([big_samples[77][1000] ^ 0x01]))])
    with FileReader(path, client=fs) as r:
        batch = [i for i in range(64) if i != 77][:40] + [77] + list(range(10))
        with pytest.raises(ThreeFSError, match=r"sample 77 \(sample 77 of /.*/big.ffr") as e:
            r.read(batch)
        assert e.value.code == StatusCode.CHECKSUM_MISMATCH
        assert len(r.read([76, 78])) == 2  # the others still read
