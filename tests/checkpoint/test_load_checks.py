"""The load's checksums: each tensor's save-time crc32c is the end-to-end check, so the per-IO check on
arrival is skipped while it is on (one crc32c pass over the bytes, not two); a tensor that fails is read
again with the arrival check on before the checkpoint is called damaged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from threefs.checkpoint import CheckpointManager, tensor_io
from threefs.common.status import StatusCode, ThreeFSError


def _state(gen, n=5):
    return {f"t{i}": torch.randint(-2**15, 2**15, (1 + 37 * i, 3001), dtype=torch.int16, generator=gen)
            .view(torch.bfloat16) for i in range(n)}


def test_unchecked_arrival_reads_the_same_bytes(fs, d):
    gen = torch.Generator().manual_seed(11)
    data = torch.randint(0, 256, (3 * 1024 * 1024 + 17,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    path = f"{d}/blob"
    fs.write_bytes(path, data)
    for check in (True, False):
        buf = bytearray(len(data) + 100)
        got = fs.batch_read([(path, 0, memoryview(buf)[:len(data)]), (path, 5, 70, memoryview(buf)[len(data):])],
                            check_arrival=check)
        assert got == [len(data), 70]
        assert bytes(buf[:len(data)]) == data and bytes(buf[len(data):len(data) + 70]) == data[5:75]


def test_verified_load_round_trips_and_read_again_restores_a_damaged_destination(fs, d):
    gen = torch.Generator().manual_seed(12)
    sd = _state(gen)
    mgr = CheckpointManager(fs, f"{d}/ck", chunk_size=1 << 20)
    mgr.save(sd, step=1)
    out = mgr.load(1)
    assert all(torch.equal(out[k].view(torch.int16), sd[k].view(torch.int16)) for k in sd)
    # the fallback on its own: a destination whose bytes are wrong is read again, checked on arrival
    index = mgr.index(1)
    e = next(t for _, t in index.all_tensors() if t.name == "t3")
    attr = fs.stat(f"{mgr.path_of(1)}/{e.file}")
    dest = torch.zeros_like(sd["t3"])
    assert tensor_io._read_again_checked(fs, e, attr, dest) == e.crc
    assert torch.equal(dest.view(torch.int16), sd["t3"].view(torch.int16))


def test_bytes_damaged_on_storage_still_fail_the_load_after_the_read_again(fs, d):
    gen = torch.Generator().manual_seed(13)
    sd = _state(gen)
    mgr = CheckpointManager(fs, f"{d}/ck", chunk_size=1 << 20)
    mgr.save(sd, step=2)
    e = next(t for _, t in mgr.index(2).all_tensors() if t.name == "t2")
    path = f"{mgr.path_of(2)}/{e.file}"
    with fs.open(path, "r+b") as f:  # a valid write of wrong bytes: every replica and chunk crc agree
        f.seek(e.offset + e.nbytes // 2)
        old = f.read(1)
        f.seek(e.offset + e.nbytes // 2)
        f.write(bytes([old[0] ^ 0x40]))
    with pytest.raises(ThreeFSError) as err:
        mgr.load(2)
    assert err.value.code == StatusCode.CHECKSUM_MISMATCH and "'t2'" in err.value.message
    out = mgr.load(2, verify=False)  # unverified, the arrival check is on and the bytes come as stored
    flat = out["t2"].view(torch.uint8).reshape(-1).numpy()
    want = sd["t2"].view(torch.uint8).reshape(-1).numpy().copy()
    want[e.nbytes // 2] ^= 0x40
    assert np.array_equal(flat, want)


def test_whole_file_load_gives_independent_tensors_of_every_kind(fs, d):
    gen = torch.Generator().manual_seed(14)
    sd = {"big": torch.randn(700, 1500, generator=gen), "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
          "np": np.arange(12345, dtype=np.int32).reshape(5, -1), "bool": torch.rand(999, generator=gen) > 0.5,
          "f8": torch.randn(333, generator=gen).to(torch.float8_e4m3fn)}
    mgr = CheckpointManager(fs, f"{d}/ck", chunk_size=1 << 20)
    mgr.save(sd, step=3)
    out = mgr.load(3)
    for k in ("big", "empty", "scalar", "bool", "f8"):
        assert out[k].dtype == sd[k].dtype and out[k].shape == sd[k].shape
        assert torch.equal(out[k].reshape(-1).view(torch.uint8), sd[k].reshape(-1).view(torch.uint8))
    assert out["np"].dtype == np.int32 and np.array_equal(out["np"], sd["np"]) and out["np"].flags.writeable
    # each tensor owns a storage of exactly its bytes: writes stay inside it, torch.save keeps just it
    out["big"].zero_()
    assert torch.equal(out["scalar"], sd["scalar"]) and torch.equal(out["bool"], sd["bool"])
    assert out["bool"].untyped_storage().nbytes() == sd["bool"].numel()


def test_truncated_data_file_names_the_first_missing_tensor(fs, d):
    gen = torch.Generator().manual_seed(15)
    sd = _state(gen)
    mgr = CheckpointManager(fs, f"{d}/ck", chunk_size=1 << 20)
    mgr.save(sd, step=4)
    e = next(t for _, t in mgr.index(4).all_tensors() if t.name == "t3")
    fs.truncate(f"{mgr.path_of(4)}/{e.file}", e.offset + 10)
    with pytest.raises(ThreeFSError) as err:
        mgr.load(4)
    assert err.value.code == StatusCode.CHECKSUM_MISMATCH and "'t3'" in err.value.message
    assert "cut short" in err.value.message
