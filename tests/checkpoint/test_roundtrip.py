"""Save/load round trips through a real cluster: every dtype, odd tensors, nested containers,
selection, `into`, retention, atomic publish, corruption detection."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from threefs.checkpoint import CheckpointManager
from threefs.checkpoint.format import INDEX_NAME
from threefs.common.status import StatusCode, ThreeFSError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
          torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]


def _random(dtype, shape, gen):
    if dtype == torch.bool:  # bytes other than 0/1 are not valid bools (copies normalise them)
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)  # every bit pattern, NaNs included: compared bytewise


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return type(a) is type(b) and a == b


def test_every_dtype_and_odd_tensors_round_trip(fs, d):
    gen = torch.Generator().manual_seed(1)
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    state = {
        "dtypes": {str(dt): _random(dt, (3, 5), gen) for dt in DTYPES},
        "empty": torch.empty(0, 7),
        "scalar0d": torch.tensor(3.25, dtype=torch.bfloat16),
        "transposed": base.t(),  # non-contiguous
        "strided": base[:, ::2],
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "numpy": {"f4": np.arange(10, dtype=np.float32), "i8be": np.arange(5, dtype=">i8"),
                  "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)), "empty": np.zeros((0, 3)),
                  "scalar": np.float64(2.5), "bool": np.array([True, False])},
        "nested": collections.OrderedDict(a=[1, 2.5, None, "x", b"raw", (True, -7)], b={3: "int key", (1, 2): "tuple key"}),
        "values": {"huge": 2**80, "neg": -(2**70), "nan": float("nan"), "dtype": torch.bfloat16,
                   "size": torch.Size([2, 3]), "device": torch.device("cpu")},
    }
    m = CheckpointManager(fs, f"{d}/run")
    path = m.save(state, step=7)
    assert path.endswith("step-0000000007")
    out = m.load()
    assert set(out) == set(state)
    for key in state:
        if key in ("transposed", "strided"):
            assert torch.equal(out[key], state[key]) and out[key].is_contiguous()
        elif key == "param":
            assert torch.equal(out[key], state[key].detach()) and type(out[key]) is torch.Tensor
        elif key == "numpy":
            for k, v in state[key].items():
                assert np.array_equal(out[key][k], v) and out[key][k].dtype == np.asarray(v).dtype, k
        else:
            assert _same(state[key], out[key]), key


def test_selection_into_and_map_location(fs, d):
    m = CheckpointManager(fs, f"{d}/run")
    model = {"layers.0.w": torch.randn(8, 8), "layers.1.w": torch.randn(8, 8), "head": torch.randn(3)}
    state = {"model": model, "optim": {"lr": 0.1, "m": torch.randn(8)}, "step": 5}
    m.save(state, step=1)
    part = m.load(prefixes=["model"])
    assert set(part) == {"model"} and set(part["model"]) == set(model)
    one = m.load(names=["model.head", "step"])
    assert set(one) == {"model", "step"} and set(one["model"]) == {"head"} and one["step"] == 5
    with pytest.raises(FileNotFoundError, match="no tensor or value named 'model.nope'"):
        m.load(names=["model.nope"])
    with pytest.raises(FileNotFoundError, match="nothing is named"):
        m.load(prefixes=["nothing"])
    # into: read straight into the caller's tensors (same objects come back)
    dest = {"model": {k: torch.empty_like(v) for k, v in model.items()}}
    keep = dest["model"]["head"]
    got = m.load(prefixes=["model"], into=dest)
    assert got["model"]["head"] is keep and torch.equal(keep, model["head"])
    # a non-contiguous destination is filled through a copy
    nc = torch.empty(8, 8).t()
    got = m.load(names=["model.layers.0.w"], into={"model": {"layers.0.w": nc}})
    assert torch.equal(nc, model["layers.0.w"]) and got["model"]["layers.0.w"] is nc
    with pytest.raises(ThreeFSError, match="in the checkpoint but"):
        m.load(prefixes=["model"], into={"model": {"head": torch.empty(4)}})
    meta = m.load(prefixes=["model"], map_location="meta")
    assert meta["model"]["head"].device.type == "meta"


def test_refuses_unsafe_values_naming_them(fs, d):
    m = CheckpointManager(fs, f"{d}/run")

    class Opaque:
        pass

    with pytest.raises(ThreeFSError, match=r"cannot save 'optim\.extra' of type .*Opaque") as e:
        m.save({"optim": {"extra": Opaque()}}, step=1)
    assert e.value.code == StatusCode.INVALID_ARGUMENT
    with pytest.raises(ThreeFSError, match="only dense"):
        m.save({"sp": torch.eye(3).to_sparse()}, step=1)
    with pytest.raises(ThreeFSError, match="objects or records"):
        m.save({"o": np.array([object()])}, step=1)
    assert m.steps() == [] and m.partial() == []  # refused before anything was written


def test_retention_and_overwrite(fs, d):
    m = CheckpointManager(fs, f"{d}/run", keep_last=2, keep_every=4)
    for step in range(1, 10):
        m.save({"w": torch.full((4,), float(step))}, step=step)
    assert m.steps() == [4, 8, 9]
    with pytest.raises(FileExistsError, match="already exists"):
        m.save({"w": torch.zeros(4)}, step=9)
    m.save({"w": torch.full((4,), -1.0)}, step=9, overwrite=True)
    assert torch.equal(m.load(9)["w"], torch.full((4,), -1.0))
    assert m.partial() == []
    m.remove(4)
    assert m.steps() == [8, 9]
    with pytest.raises(FileNotFoundError):
        m.remove(4)


def test_async_save_one_in_flight(fs, d):
    m = CheckpointManager(fs, f"{d}/run")
    w = torch.randint(-1000, 1000, (256, 1024)).float()  # integers: w + 1 - 1 is exact
    futs = []
    for step in range(3):
        futs.append(m.async_save({"w": w, "step": step}, step=step))
        w.add_(1.0)  # the snapshot was taken: changing the tensor now must not change the save
    for step, f in enumerate(futs):
        assert f.result(timeout=120).endswith(f"step-{step:010d}")
    for step in range(3):
        assert torch.equal(m.load(step)["w"], w - (3 - step))
    bad = m.async_save({"w": w}, step=1)  # exists: the failure is on the future
    with pytest.raises(FileExistsError):
        bad.result(timeout=60)
    m.close()


def test_corrupted_byte_is_detected_with_the_tensor_name(fs, d):
    m = CheckpointManager(fs, f"{d}/run")
    m.save({"a": torch.arange(1000, dtype=torch.int32), "b": torch.ones(3000)}, step=3)
    idx = m.index(3)
    entry = next(e for e in idx.ranks[0].tensors if e.name == "b")
    data = f"{m.path_of(3)}/{entry.file}"
    buf = bytearray(1)
    fs.batch_read([(data, entry.offset + 777, buf)])
    buf[0] ^= 0x40
    fs.batch_write([(data, entry.offset + 777, bytes(buf))])
    with pytest.raises(ThreeFSError, match=r"tensor 'b' failed its checksum") as e:
        m.load(3)
    assert e.value.code == StatusCode.CHECKSUM_MISMATCH
    assert torch.equal(m.load(3, names=["a"])["a"], torch.arange(1000, dtype=torch.int32))
    assert m.load(3, verify=False)["b"].shape == (3000,)  # verification can be turned off


def test_damaged_index_and_missing_checkpoint_errors(fs, d):
    m = CheckpointManager(fs, f"{d}/run")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        m.load()
    m.save({"a": torch.ones(2)}, step=1)
    fs.write_bytes(f"{m.path_of(1)}/{INDEX_NAME}", b"\x93garbage")
    with pytest.raises(ThreeFSError, match="unreadable checkpoint index"):
        m.load(1)
    with pytest.raises(ThreeFSError, match="step must be an int"):
        m.save({}, step=-1)
    with pytest.raises(ThreeFSError, match="keep_last"):
        CheckpointManager(fs, f"{d}/x", keep_last=0)
