"""safetensors files on threefs, through the batch path: one read for the header, one batch read
straight into freshly allocated tensors.

    from threefs.checkpoint import safetensors as st
    tensors = st.load_file(fs, "/models/llama/model-00001-of-00004.safetensors")
    st.save_file(fs, {"w": w}, "/models/out.safetensors", metadata={"format": "pt"})

The format (github.com/huggingface/safetensors): u64 little-endian header length N, N bytes of
JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the
data; offsets are relative to the end of the header. Files written here load with the safetensors
library and the other way round (tests/checkpoint/test_safetensors.py).
"""

from __future__ import annotations

import json
import struct
import uuid

from threefs.checkpoint import tensor_io
from threefs.checkpoint.format import TensorEntry, element_count, selector
from threefs.common import limits
from threefs.common.status import StatusCode, status_error

HEADER_BYTES_MAX = 100_000_000  # the safetensors library's own limit
DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
          "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64",
          "I64": "int64", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
          "C64": "complex64"}
CODES = {v: k for k, v in DTYPES.items()}


def read_header(client, path: str) -> tuple[dict, int, object]:
    """(header dict, data start offset, file attr)."""
    attr = client.stat(path)
    if attr.length < 8:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: {attr.length} bytes is too short for a "
                           "safetensors file")
    size = bytearray(8)
    client.batch_read([(attr, 0, size)])
    (n,) = struct.unpack("<Q", size)
    if n > HEADER_BYTES_MAX or 8 + n > attr.length:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: header length {n} is invalid for a file of "
                           f"{attr.length} bytes (not a safetensors file, or truncated)")
    raw = bytearray(n)
    client.batch_read([(attr, 8, raw)])
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: header is not a JSON object")
    return header, 8 + n, attr


def entries(header: dict, start: int, attr, path: str) -> list[TensorEntry]:
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], [int(x) for x in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: tensor {name!r} has a malformed "
                               "header entry") from None
        if code not in DTYPES:
            raise status_error(StatusCode.NOT_SUPPORTED, f"{path}: tensor {name!r} has dtype {code}, which "
                               f"this reader does not know ({', '.join(DTYPES)})")
        import torch

        itemsize = torch.empty((), dtype=getattr(torch, DTYPES[code])).element_size()
        nbytes = element_count(shape) * itemsize
        if not (0 <= begin <= end and end - begin == nbytes and start + end <= attr.length):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: tensor {name!r} has data offsets "
                               f"[{begin}, {end}) that do not fit {code} {shape} in a {attr.length}-byte file")
        out.append(TensorEntry(name, "torch", DTYPES[code], shape, path, start + begin, nbytes, 0))
    return out


def load_file(client, path: str, device: str = "cpu", *, names=None, prefixes=None) -> dict:
    """{name: tensor} of a safetensors file on threefs (optionally only some names / prefixes)."""
    header, start, attr = read_header(client, path)
    wanted = selector(names, prefixes)
    chosen = [e for e in entries(header, start, attr, path) if wanted(e.name)]
    missing = set(names or ()) - {e.name for e in chosen}
    if missing:
        raise status_error(StatusCode.NOT_FOUND, f"{path}: no tensor named {sorted(missing)[0]!r}")
    out = {e.name: tensor_io.empty_like_entry(e) for e in chosen}
    tensor_io.read_into(client, [(e, attr, out[e.name]) for e in chosen], verify=False, where=path)
    if str(device) != "cpu":
        out = {k: v.to(device) for k, v in out.items()}
    return out


def metadata(client, path: str) -> dict[str, str]:
    header, _, _ = read_header(client, path)
    return dict(header.get("__metadata__") or {})


def save_file(client, tensors: dict, path: str, metadata: dict[str, str] | None = None,
              chunk_size: int = 4 * limits.MiB) -> None:
    """Write tensors as a safetensors file (written aside, then renamed into place)."""
    import torch

    header: dict = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise status_error(StatusCode.INVALID_ARGUMENT, "safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{name!r} is a {type(t).__name__}, not a tensor "
                               "(safetensors holds str -> tensor only)")
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # as the library: aligned
    off = 0
    for name in order:
        t = tensors[name]
        code = CODES.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise status_error(StatusCode.NOT_SUPPORTED, f"{name!r}: dtype {t.dtype} has no safetensors code")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the library pads the header to 8 bytes
    start = 8 + len(raw)
    staging = tensor_io.Staging()
    buf = staging.get(start + off)
    buf[:8] = memoryview(struct.pack("<Q", len(raw))).cast("B")
    buf[8:start] = memoryview(raw).cast("B")
    for name in order:
        begin, end = header[name]["data_offsets"]
        if end > begin:
            tensor_io.copy_into(buf[start + begin:start + end], tensors[name])
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    tensor_io.write_pieces(client, tmp, buf, chunk_size, tensor_io.PIECE_BYTES_DEFAULT)
    client.rename(tmp, path)
