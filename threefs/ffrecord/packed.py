"""Packed folders: a tree of small files as one .ffr file with a name index (the reference's
PackedFolder).

    pack_folder("imagenet/val", "/data/val.ffr", client=fs)
    pf = PackedFolder("/data/val.ffr", client=fs)
    pf.list("n01440764")             # names in a folder
    imgs = pf.read(["n01440764/ILSVRC2012_val_00000293.JPEG", ...])   # one batch read

Files are samples 0..k-1 in sorted depth-first order; the last sample is the index, a tree
{name: sample index | {name: ...}}. Ours stores the tree as JSON after INDEX_MAGIC. The reference
stores b"piouhjgbr" + a pickle; we never run a pickle from storage: such an index is parsed with a
restricted unpickler that can build only dicts/OrderedDicts of str and int (any other class or
callable in the pickle is refused with an error), and the tree's shape is checked before use.
`pack_folder(..., reference=True)` writes the reference's layout (v1 + pickle index) for ffrecord.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections import OrderedDict

from threefs.common import limits
from threefs.common.status import StatusCode, status_error
from threefs.ffrecord.reader import FileReader
from threefs.ffrecord.writer import FileWriter

INDEX_MAGIC = b"threefs-packed-folder-json\n"
REFERENCE_MAGIC = b"piouhjgbr"
INDEX_BYTES_MAX = 256 * limits.MiB  # a name index larger than this is refused before parsing
FILES_MAX = 50_000_000  # files in one packed folder


class _TreeUnpickler(pickle.Unpickler):
    """Builds only OrderedDict / dict of str and int: a pickle naming any other global is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise status_error(StatusCode.NOT_SUPPORTED, f"packed-folder index refers to {module}.{name}; "
                           "only OrderedDict name trees are accepted (the index is not trusted code)")


def _check_tree(tree, nfiles: int, where: str = "/") -> None:
    if not isinstance(tree, dict):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"packed-folder index: {where} is not a folder")
    for name, value in tree.items():
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"packed-folder index: bad name {name!r} in {where}")
        if isinstance(value, dict):
            _check_tree(value, nfiles, f"{where}{name}/")
        elif not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < nfiles:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"packed-folder index: {where}{name} points "
                               f"to {value!r}, not a sample in [0, {nfiles})")


def parse_index(meta: bytes, nfiles: int, path: str) -> dict:
    """The name tree of a packed folder from its last sample (ours: JSON; the reference: pickle)."""
    if len(meta) > INDEX_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: index of {len(meta)} bytes exceeds "
                           f"{INDEX_BYTES_MAX}")
    if meta.startswith(INDEX_MAGIC):
        try:
            tree = json.loads(meta[len(INDEX_MAGIC):])
        except ValueError as e:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: corrupt packed-folder index: {e}") from None
    elif meta.startswith(REFERENCE_MAGIC):
        try:
            tree = _TreeUnpickler(io.BytesIO(meta[len(REFERENCE_MAGIC):])).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: corrupt packed-folder index: {e}") from None
    else:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{path} is not a packed folder (its last sample "
                           "is not a name index); read it with FileReader")
    _check_tree(tree, nfiles)
    return tree


class PackedFolder:
    """Read files of a packed folder by name; `client=None` reads a local .ffr file."""

    def __init__(self, ffr_file, check_data: bool = True, *, client=None):
        self.reader = FileReader(ffr_file, check_data, client=client)
        if self.reader.n == 0:
            self.reader.close()
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{ffr_file} is empty, not a packed folder")
        try:
            meta = self.reader.read_one(self.reader.n - 1).tobytes()
            self.structure = parse_index(meta, self.reader.n - 1, str(ffr_file))
        except BaseException:
            self.reader.close()
            raise

    def num_files(self) -> int:
        return self.reader.n - 1

    def _node(self, path) -> dict | int:
        node = self.structure
        for part in _parts(path):
            if not isinstance(node, dict) or part not in node:
                raise status_error(StatusCode.NOT_FOUND, f"{path}: no such file or folder in the pack")
            node = node[part]
        return node

    def index_of(self, fname) -> int:
        node = self._node(fname)
        if isinstance(node, dict):
            raise status_error(StatusCode.IS_DIRECTORY, f"{fname} is a folder, not a file")
        return node

    def read_one(self, fname):
        """The bytes of one packed file, as a uint8 array."""
        return self.reader.read_one(self.index_of(fname))

    def read(self, fnames) -> list:
        """Several packed files in one batch read."""
        if not isinstance(fnames, (list, tuple)):
            raise status_error(StatusCode.INVALID_ARGUMENT, "fnames must be a list of names")
        return self.reader.read([self.index_of(f) for f in fnames])

    def exists(self, path) -> bool:
        try:
            self._node(path)
            return True
        except FileNotFoundError:
            return False

    def is_file(self, path) -> bool:
        return self.exists(path) and not isinstance(self._node(path), dict)

    def is_dir(self, path) -> bool:
        return self.exists(path) and isinstance(self._node(path), dict)

    def list(self, path=None, list_file: bool = True, list_dir: bool = True, recursive: bool = False) -> list[str]:
        """Names in a folder (the root by default); recursive names are relative paths."""
        node = self.structure if path is None else self._node(path)
        if not isinstance(node, dict):
            raise status_error(StatusCode.NOT_DIRECTORY, f"{path} is a file, not a folder")
        return list(_walk(node, "", list_file, list_dir, recursive))

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> "PackedFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parts(path) -> list[str]:
    return [p for p in os.fspath(path).split("/") if p not in ("", ".")]


def _walk(node: dict, prefix: str, list_file: bool, list_dir: bool, recursive: bool):
    for name, value in node.items():
        is_dir = isinstance(value, dict)
        if (list_dir if is_dir else list_file):
            yield prefix + name
        if recursive and is_dir:
            yield from _walk(value, f"{prefix}{name}/", list_file, list_dir, recursive)


def scan_folder(folder: str, depth: int = 0) -> tuple[OrderedDict, list[str]]:
    """(name tree, file paths in sample order): sorted depth-first, as the reference packs."""
    if depth > limits.PATH_DEPTH_MAX:
        raise status_error(StatusCode.TOO_MANY_SYMLINKS, f"{folder}: deeper than {limits.PATH_DEPTH_MAX} "
                           "levels (a symlink loop?)")
    tree: OrderedDict = OrderedDict()
    files: list[str] = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            sub, sub_files = scan_folder(path, depth + 1)
            tree[name] = _shift(sub, len(files))
            files += sub_files
        elif os.path.isfile(path):
            tree[name] = len(files)
            files.append(path)
        else:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{path} is neither a regular file nor a "
                               "folder (a dangling symlink, a socket or a device?); remove it or pack "
                               "a folder without it")
        if len(files) > FILES_MAX:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{folder}: more than {FILES_MAX} files")
    return tree, files


def _shift(tree: OrderedDict, base: int) -> OrderedDict:
    return OrderedDict((k, _shift(v, base) if isinstance(v, dict) else v + base) for k, v in tree.items())


def encode_index(tree: OrderedDict, reference: bool) -> bytes:
    if reference:  # written for HFAiLab's PackedFolder, which can only read a pickle
        return REFERENCE_MAGIC + pickle.dumps(tree)
    return INDEX_MAGIC + json.dumps(tree, ensure_ascii=False, separators=(",", ":")).encode()


def pack_folder(folder, out_file, *, client=None, version: int | None = None, reference: bool = False,
                progress=None) -> int:
    """Pack every file under local `folder` into `out_file` (a threefs path with `client`, else local).
    reference=True writes HFAiLab's layout (v1, pickle index). progress(nbytes) after each file.
    Returns the number of files packed."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise status_error(StatusCode.NOT_DIRECTORY, f"{folder} is not a folder")
    tree, files = scan_folder(folder)
    if version is None:
        version = 1 if reference else 2
    index = encode_index(tree, reference)
    with FileWriter(out_file, len(files) + 1, client=client, version=version) as w:
        for path in files:
            with open(path, "rb") as f:
                data = f.read()
            w.write_one(data)
            if progress is not None:
                progress(len(data))
        w.write_one(index)
    return len(files)
