"""safetensors interop: files written by the safetensors library load through the batch path, files
written here load with the library; malformed files give clear errors."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import load_file as st_load
from safetensors.torch import save_file as st_save

from threefs.checkpoint import safetensors as st
from threefs.common.status import ThreeFSError


def _tensors():
    g = torch.Generator().manual_seed(3)
    return {"embed": torch.randn(64, 32, generator=g), "ln.bias": torch.randn(32, generator=g).half(),
            "q": torch.randn(16, 16, generator=g).to(torch.bfloat16), "mask": torch.rand(7, generator=g) > 0.5,
            "ids": torch.randint(-5, 5, (9,), generator=g), "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5)}


def test_library_file_loads_through_threefs(fs, d, tmp_path):
    want = _tensors()
    local = tmp_path / "m.safetensors"
    st_save(want, str(local), metadata={"format": "pt"})
    fs.put(str(local), f"{d}/m.safetensors")
    got = st.load_file(fs, f"{d}/m.safetensors")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert st.metadata(fs, f"{d}/m.safetensors") == {"format": "pt"}
    part = st.load_file(fs, f"{d}/m.safetensors", prefixes=["ln"])
    assert list(part) == ["ln.bias"]
    with pytest.raises(FileNotFoundError, match="no tensor named 'nope'"):
        st.load_file(fs, f"{d}/m.safetensors", names=["nope"])


def test_threefs_file_loads_with_the_library(fs, d, tmp_path):
    want = _tensors()
    st.save_file(fs, want, f"{d}/o.safetensors", metadata={"step": "7"})
    assert not any(n.endswith(".tmp") for n in fs.listdir(d))
    fs.get(f"{d}/o.safetensors", str(tmp_path / "o.safetensors"))
    got = st_load(str(tmp_path / "o.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ThreeFSError, match="not a tensor"):
        st.save_file(fs, {"x": [1, 2]}, f"{d}/bad.safetensors")


def test_malformed_files_are_refused_clearly(fs, d):
    fs.write_bytes(f"{d}/short", b"abc")
    with pytest.raises(ThreeFSError, match="too short"):
        st.load_file(fs, f"{d}/short")
    fs.write_bytes(f"{d}/huge", struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ThreeFSError, match="header length"):
        st.load_file(fs, f"{d}/huge")
    hdr = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    fs.write_bytes(f"{d}/cut", struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8)  # 8 of 16 data bytes
    with pytest.raises(ThreeFSError, match="'w' has data offsets"):
        st.load_file(fs, f"{d}/cut")
    hdr = b'{"w":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}'
    fs.write_bytes(f"{d}/dtype", struct.pack("<Q", len(hdr)) + hdr + b"\0")
    with pytest.raises(ThreeFSError, match="dtype Q9"):
        st.load_file(fs, f"{d}/dtype")
