"""On-storage format of a threefs checkpoint: the index and the safe encoding of the state tree.

A checkpoint is a directory:

    ROOT/step-0000000100/
        index.msgpack          every tensor: name, dtype, shape, file, offset, nbytes, crc32c;
                               the state tree (containers and plain values) of every rank
        data-r00000.bin        rank 0's tensor bytes, back to back (64-byte aligned offsets)
        data-r00001.bin        ...

Nothing on load is unpickled. The tree holds only tagged plain values (dicts, lists, tuples, None,
bool, int, float, str, bytes, torch dtypes/sizes/devices, numpy scalars) and references to index
entries, the way torch.load(weights_only=True) and safetensors refuse arbitrary objects. A value
of any other type is refused at save time, naming where it is in the state dict.
"""

from __future__ import annotations

import collections
import math
import sys
from typing import Any

import msgspec
import numpy as np

from threefs.common.status import StatusCode, status_error

FORMAT = "threefs-checkpoint"
VERSION = 1
INDEX_NAME = "index.msgpack"
ALIGN = 64  # tensor offsets in a data file: keeps every dtype's view of a staging buffer aligned
INT_MAX = 2**63 - 1
INT_MIN = -(2**63)


class TensorEntry(msgspec.Struct, array_like=True):
    name: str  # dotted path in the state dict ("model.layers.0.weight")
    kind: str  # "torch" | "numpy"
    dtype: str  # torch: "bfloat16"; numpy: dtype.str ("<f4")
    shape: list[int]
    file: str  # data file, relative to the checkpoint directory
    offset: int
    nbytes: int
    crc: int  # crc32c of the bytes


class RankIndex(msgspec.Struct):
    tree: Any
    tensors: list[TensorEntry]


class Index(msgspec.Struct):
    format: str
    version: int
    step: int
    created_unix: float
    ranks: list[RankIndex]
    user_meta: dict[str, str] = {}

    def all_tensors(self):
        for r, ri in enumerate(self.ranks):
            for t in ri.tensors:
                yield r, t

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t in self.all_tensors())


def encode_index(index: Index) -> bytes:
    return msgspec.msgpack.encode(index)


def decode_index(data: bytes, where: str) -> Index:
    try:
        index = msgspec.msgpack.decode(data, type=Index)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise status_error(StatusCode.CHECKSUM_MISMATCH, f"{where}: unreadable checkpoint index ({e})") from None
    if index.format != FORMAT:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{where}: not a threefs checkpoint ({index.format!r})")
    if index.version > VERSION:
        raise status_error(StatusCode.NOT_SUPPORTED, f"{where}: checkpoint format version {index.version} is "
                           f"newer than this threefs understands ({VERSION}); upgrade threefs")
    return index


def encode_index_part(part: RankIndex) -> bytes:
    return msgspec.msgpack.encode(part)


def decode_index_part(data: bytes, where: str) -> RankIndex:
    try:
        return msgspec.msgpack.decode(data, type=RankIndex)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise status_error(StatusCode.CHECKSUM_MISMATCH, f"{where}: unreadable rank index ({e})") from None


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- dtypes ----------------------------------------------------------------------------------------
def torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise status_error(StatusCode.NOT_SUPPORTED, f"unknown torch dtype {name!r} in checkpoint "
                           "(saved by a newer torch?)")
    return dt


def numpy_dtype(name: str) -> np.dtype:
    try:
        dt = np.dtype(name)
    except TypeError:
        raise status_error(StatusCode.NOT_SUPPORTED, f"unknown numpy dtype {name!r} in checkpoint") from None
    if dt.hasobject or dt.fields is not None:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"numpy dtype {name!r} is not a plain numeric dtype")
    return dt


# -- the state tree --------------------------------------------------------------------------------
# A node is a list: [tag, payload...]. Tags:
#   "v" plain value (None/bool/int/float/str/bytes)   "I" big int as a decimal string
#   "d" dict   "o" OrderedDict   (payload: [[key node, value node], ...])
#   "l" list   "t" tuple         (payload: [node, ...])
#   "T" torch tensor, "N" numpy array (payload: index into the rank's tensors)
#   "ns" numpy scalar [dtype.str, bytes]   "dt" torch dtype   "sz" torch.Size   "dev" torch.device

class TreeEncoder:
    """Walks a state dict; collects tensors (in order) and returns the tagged tree."""

    def __init__(self):
        self.tensors: list[tuple[str, Any]] = []  # (name, tensor or ndarray)
        # a state dict can only hold torch objects if torch is imported: do not import it (~2 s) otherwise
        self._torch = sys.modules.get("torch")

    def encode(self, obj, name: str = "") -> list:
        torch = self._torch
        if isinstance(obj, np.generic):  # before float: np.float64 is a float subclass
            if obj.dtype.hasobject or obj.dtype.fields is not None:
                raise _refuse(name, obj, "numpy object scalars cannot be stored safely")
            return ["ns", obj.dtype.str, obj.tobytes()]
        if obj is None or isinstance(obj, (bool, str, bytes)):
            return ["v", obj]
        if isinstance(obj, int):
            return ["v", obj] if INT_MIN <= obj <= INT_MAX else ["I", str(obj)]
        if isinstance(obj, float):
            return ["v", obj]
        if torch is not None and isinstance(obj, torch.Tensor):
            return ["T", self._add(name, obj)]
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject or obj.dtype.fields is not None:
                raise _refuse(name, obj, "numpy arrays of objects or records cannot be stored safely")
            return ["N", self._add(name, obj)]
        if isinstance(obj, (dict, collections.OrderedDict)):
            tag = "o" if isinstance(obj, collections.OrderedDict) else "d"
            return [tag, [[self._key(k, name), self.encode(v, _join(name, k))] for k, v in obj.items()]]
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            tag = "l" if isinstance(obj, list) else "t"
            return [tag, [self.encode(v, _join(name, i)) for i, v in enumerate(obj)]]
        if torch is not None:
            if isinstance(obj, torch.dtype):
                return ["dt", torch_dtype_name(obj)]
            if isinstance(obj, torch.Size):
                return ["sz", list(obj)]
            if isinstance(obj, torch.device):
                return ["dev", str(obj)]
        raise _refuse(name, obj, "only tensors, numpy arrays, containers (dict, list, tuple) and plain "
                      "values (None, bool, int, float, str, bytes) are stored; convert it (e.g. to a "
                      "dict or a string) before saving")

    def _key(self, k, name: str) -> list:
        if k is None or isinstance(k, (bool, int, float, str, bytes)):
            return self.encode(k, name)
        if isinstance(k, tuple):
            return self.encode(k, name)
        raise _refuse(name, k, "dict keys must be plain values or tuples of them")

    def _add(self, name: str, t) -> int:
        self.tensors.append((name, t))
        return len(self.tensors) - 1


def _join(prefix: str, key) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _refuse(name: str, obj, why: str):
    return status_error(StatusCode.INVALID_ARGUMENT,
                        f"cannot save {name or 'the state dict'!r} of type {type(obj).__qualname__}: {why}")


def decode_tree(node, leaf, wanted=None, name: str = ""):
    """Rebuild a tree; leaf(tag, tensor index, name) gives tensors ("T"/"N"). wanted(name) selects
    leaves (default: all); containers left with no selected leaf are dropped (SKIP), except that a
    partly selected list keeps its positions (None where a leaf was not selected)."""
    tag = node[0]
    if tag in ("T", "N"):
        return leaf(tag, node[1], name)
    if tag in ("d", "o"):
        out = collections.OrderedDict() if tag == "o" else {}
        for knode, vnode in node[1]:
            key = decode_tree(knode, _no_tensor_keys)
            value = decode_tree(vnode, leaf, wanted, _join(name, key))
            if value is not SKIP:
                out[key] = value
        return out if out or (not node[1] and _wants(wanted, name)) else SKIP
    if tag in ("l", "t"):
        items = [decode_tree(v, leaf, wanted, _join(name, i)) for i, v in enumerate(node[1])]
        if all(v is SKIP for v in items) and (node[1] or not _wants(wanted, name)):
            return SKIP
        items = [None if v is SKIP else v for v in items]
        return items if tag == "l" else tuple(items)
    if not _wants(wanted, name):
        return SKIP
    if tag == "v":
        return node[1]
    if tag == "I":
        return int(node[1])
    if tag == "ns":
        return np.frombuffer(node[2], dtype=numpy_dtype(node[1]))[0]
    if tag == "dt":
        return torch_dtype(node[1])
    if tag == "sz":
        import torch

        return torch.Size(node[1])
    if tag == "dev":
        import torch

        return torch.device(node[1])
    raise status_error(StatusCode.NOT_SUPPORTED, f"unknown value tag {tag!r} at {name!r} in checkpoint")


def _wants(wanted, name: str) -> bool:
    return wanted is None or wanted(name)


class _Skip:
    def __repr__(self):
        return "SKIP"


SKIP = _Skip()


def _no_tensor_keys(tag, i, name):
    raise status_error(StatusCode.INVALID_ARGUMENT, f"tensor used as a dict key at {name!r}")


def tree_leaf_names(node, name: str = ""):
    """(name, tag) of every leaf of an encoded tree (for selection of plain values)."""
    tag = node[0]
    if tag in ("d", "o"):
        for knode, vnode in node[1]:
            yield from tree_leaf_names(vnode, _join(name, decode_tree(knode, _no_tensor_keys)))
    elif tag in ("l", "t"):
        for i, v in enumerate(node[1]):
            yield from tree_leaf_names(v, _join(name, i))
    else:
        yield name, tag


def selector(names=None, prefixes=None):
    """A predicate on dotted names: True for everything when both are None."""
    if names is None and prefixes is None:
        return lambda name: True
    names = set(names or ())
    prefixes = tuple(prefixes or ())

    def wanted(name: str) -> bool:
        return name in names or any(name == p or name.startswith(p if p.endswith(".") else p + ".")
                                    for p in prefixes)

    return wanted


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def element_count(shape) -> int:
    return math.prod(shape) if shape else 1
