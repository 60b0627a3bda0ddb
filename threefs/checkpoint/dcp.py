"""torch.distributed.checkpoint storage on threefs: dcp.save / dcp.load / dcp.async_save.

    import torch.distributed.checkpoint as dcp
    from threefs.checkpoint.dcp import ThreeFSStorageWriter, ThreeFSStorageReader

    dcp.save(state_dict, storage_writer=ThreeFSStorageWriter("threefs:///ckpt/dcp/step-100", fs))
    dcp.load(state_dict, storage_reader=ThreeFSStorageReader("threefs:///ckpt/dcp/step-100", fs))

Each rank stages its write items into one host buffer and writes one data file with batch writes
of chunk-aligned pieces; reads of a rank's items are one batch read, straight into the destination
tensors when the stored piece is exactly the destination (same world size and placement), through
a temporary of the stored piece otherwise (resharding). Every item carries a crc32c.

Publish: data files carry the save's id in their name, so an existing checkpoint in the same
directory stays intact until `.metadata` is replaced (written aside, then renamed over): a crash
mid-save leaves the previous metadata and its files readable. Files of the replaced save are
removed after the rename.

Metadata is written with torch.save and read back with torch.load(weights_only=True) allowing only
DCP's metadata classes (FileSystemReader uses plain pickle). Non-tensor values (BYTE_IO items) are
deserialised by DCP's own planner (DefaultLoadPlanner.load_bytes uses torch.load with
weights_only=False): that step is DCP's, not this storage layer's.

Exit: torch's DTensor keeps every DeviceMesh it has seen in module-level caches (sharding
propagation, redistribute planners) and a DeviceMesh holds its process groups in `_pg_registry`, so
after `dist.destroy_process_group()` the gloo group of a DTensor job stays alive, with its worker
threads, until interpreter finalisation tears it down: the state in which a rank aborted at exit
("terminate called without an active exception", rc -6). `release_process_groups()` drops those references so
the group is freed while the interpreter is alive; it runs at exit by itself (atexit, registered on
import) and `destroy_process_group()` does both steps at once. See docs/checkpoint.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import io
import uuid
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from threefs.checkpoint import tensor_io
from threefs.checkpoint.format import align_up, torch_dtype, torch_dtype_name
from threefs.checkpoint.manager import CHUNK_SIZE_DEFAULT
from threefs.common import crc32c
from threefs.common.status import StatusCode, status_error

METADATA = ".metadata"
SUFFIX = ".distcp"
SCHEME = "threefs://"


@dataclass(frozen=True)
class ThreeFSStorageInfo:
    """Where one write item's bytes are: file (relative), offset, length, dtype ("" = bytes), the
    stored piece's shape, crc32c."""
    relative_path: str
    offset: int
    length: int
    dtype: str
    shape: tuple
    crc: int


@dataclass(frozen=True)
class _Prefix:
    prefix: str


SAFE_GLOBALS = [Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                MetadataIndex, StorageMeta, ThreeFSStorageInfo, torch.Size, _dcp_md._MEM_FORMAT_ENCODING]


def _path_of(checkpoint_id) -> str:
    p = str(checkpoint_id)
    if p.startswith(SCHEME):
        p = p[len(SCHEME):]
    if not p.startswith("/"):
        raise status_error(StatusCode.INVALID_PATH, f"checkpoint id {checkpoint_id!r}: want an absolute "
                           "threefs path (threefs:///dir or /dir)")
    return p.rstrip("/") or "/"


class _ClientHolder:
    """A client that survives pickling (DCP's process-based async save pickles the writer)."""

    def __init__(self, client=None, config=None):
        self._client = client
        self._config = config if config is not None else (client.config if client is not None else None)

    @property
    def client(self):
        if self._client is None:
            from threefs.client.client import Client

            self._client = Client.connect(self._config)
        return self._client

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_client"] = None
        return state


class ThreeFSStorageWriter(_ClientHolder, StorageWriter):
    def __init__(self, path, client=None, *, config=None, overwrite: bool = True,
                 chunk_size: int = CHUNK_SIZE_DEFAULT, piece_bytes: int = tensor_io.PIECE_BYTES_DEFAULT):
        _ClientHolder.__init__(self, client, config)
        self.path = _path_of(path)
        self.overwrite = overwrite
        self.chunk_size, self.piece_bytes = chunk_size, piece_bytes
        self.save_id = uuid.uuid4().hex[:12]
        self.is_coordinator = False
        self._staging = tensor_io.Staging()

    def __getstate__(self):
        state = _ClientHolder.__getstate__(self)
        state["_staging"] = tensor_io.Staging()
        return state

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = _path_of(checkpoint_id)
        self.save_id = uuid.uuid4().hex[:12]

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=SCHEME + self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.client.mkdir(self.path, parents=True, exist_ok=True, chunk_size=self.chunk_size)
        if not self.overwrite and self.client.exists(f"{self.path}/{METADATA}"):
            raise status_error(StatusCode.EXISTS, f"{self.path} already holds a checkpoint and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_Prefix(f"__{i}_{self.save_id}"))
                if p.storage_data is None else p for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(self._write(plan, planner))
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        name = f"{plan.storage_data.prefix}{SUFFIX}"
        staged, off = [], 0
        for item in plan.items:  # resolve lazily, one item at a time into the staging layout
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = np.frombuffer(data.getbuffer(), dtype=np.uint8)
                staged.append((item, raw, off, raw.nbytes, "", ()))
            else:
                t = data.detach()
                nbytes = t.numel() * t.element_size()
                staged.append((item, t, off, nbytes, torch_dtype_name(t.dtype), tuple(t.shape)))
            off = align_up(off + staged[-1][3])
        buf = self._staging.get(off)
        results = []
        for item, data, o, n, dtype, shape in staged:
            if n:
                if dtype:
                    tensor_io.copy_into(buf[o:o + n], data)
                else:
                    buf[o:o + n] = data
            crc = crc32c.crc32c(memoryview(buf[o:o + n]))
            results.append(WriteResult(index=item.index, size_in_bytes=n,
                                       storage_data=ThreeFSStorageInfo(name, o, n, dtype, shape, crc)))
        tensor_io.write_pieces(self.client, f"{self.path}/{name}", buf, self.chunk_size, self.piece_bytes)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.storage_meta = self.storage_meta()
        out = io.BytesIO()
        torch.save(metadata, out)
        tmp = f"{self.path}/{METADATA}.{self.save_id}.tmp"
        self.client.write_bytes(tmp, out.getbuffer())
        self.client.rename(tmp, f"{self.path}/{METADATA}")  # the publish
        self._staging.release()
        live = {info.relative_path for info in metadata.storage_data.values()}
        for n in self.client.listdir(self.path):  # files of the save this one replaced
            if n.endswith(SUFFIX) and n not in live:
                self.client.remove(f"{self.path}/{n}")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return str(checkpoint_id).startswith(SCHEME)


class ThreeFSStorageReader(_ClientHolder, StorageReader):
    def __init__(self, path, client=None, *, config=None, verify: bool = True):
        _ClientHolder.__init__(self, client, config)
        self.path = _path_of(path)
        self.verify = verify
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex[:12]

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = _path_of(checkpoint_id)
        self.storage_data = {}
        self.load_id = uuid.uuid4().hex[:12]

    def read_metadata(self, *args, **kwargs) -> Metadata:
        try:
            raw = self.client.read_bytes(f"{self.path}/{METADATA}")
        except FileNotFoundError:
            raise status_error(StatusCode.NOT_FOUND, f"{self.path}: no DCP checkpoint (no {METADATA})") from None
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            try:
                md = torch.load(io.BytesIO(raw), weights_only=True)
            except Exception as e:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"{self.path}/{METADATA}: not loadable as "
                                   f"safe DCP metadata ({e})") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage_data = metadata.storage_data
        if not self.storage_data:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{self.path}: metadata has no storage data")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        fut: Future = Future()
        try:
            self._read(plan, planner)
            fut.set_result(None)
        except BaseException as e:
            fut.set_exception(e)
        return fut

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        attrs: dict[str, object] = {}
        items, after = [], []
        for req in plan.items:
            info: ThreeFSStorageInfo = self.storage_data[req.storage_index]
            if info.relative_path not in attrs:
                attrs[info.relative_path] = self.client.stat(f"{self.path}/{info.relative_path}")
            attr = attrs[info.relative_path]
            if req.type == LoadItemType.BYTE_IO:
                buf = np.empty(info.length, dtype=np.uint8)
                items.append((attr, info, buf, req))
                after.append(("bytes", req, buf, None))
                continue
            target = planner.resolve_tensor(req).detach()
            whole = (tuple(req.lengths) == tuple(info.shape) and not any(req.storage_offsets)
                     and target.dtype == torch_dtype(info.dtype))
            view = tensor_io.byte_view(target) if whole else None
            if view is not None:
                items.append((attr, info, view, req))
                after.append(("direct", req, target, None))
            else:  # resharding: read the stored piece, copy the wanted part
                tmp = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
                items.append((attr, info, tensor_io.byte_view(tmp), req))
                after.append(("narrow", req, target, tmp))
        self._batch_read(items)
        for kind, req, dest, tmp in after:
            if kind == "bytes":
                planner.load_bytes(req, io.BytesIO(dest.tobytes()))
                continue
            if kind == "narrow":
                src = tmp
                for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    src = src.narrow(dim, o, n)
                if src.shape != dest.shape:
                    raise status_error(StatusCode.INVALID_ARGUMENT, f"{req.storage_index.fqn}: stored piece "
                                       f"{tuple(src.shape)} does not fit destination {tuple(dest.shape)}")
                dest.copy_(src)
            planner.commit_tensor(req, dest)

    def _batch_read(self, items) -> None:
        reads = [(attr, info.offset, view) for attr, info, view, _ in items if info.length]
        for i in range(0, len(reads), tensor_io.BATCH_ITEMS_MAX):
            chunk = reads[i:i + tensor_io.BATCH_ITEMS_MAX]
            for (_, _, view), n in zip(chunk, self.client.batch_read(chunk)):
                if n != len(view):
                    raise status_error(StatusCode.CHECKSUM_MISMATCH, f"{self.path}: a data file is cut short "
                                       f"(read {n} of {len(view)} bytes)")
        if self.verify:
            for _, info, view, req in items:
                if info.length and crc32c.crc32c(view) != info.crc:
                    raise status_error(StatusCode.CHECKSUM_MISMATCH, f"{self.path}: {req.storage_index.fqn!r} "
                                       f"failed its checksum in {info.relative_path}; the checkpoint is damaged")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return str(checkpoint_id).startswith(SCHEME)


def release_process_groups() -> int:
    """Release the process groups that DeviceMeshes still hold after `destroy_process_group()`, so
    they are freed (their gloo threads joined, rank 0's TCPStore server stopped) now, in this thread
    with the interpreter alive, and not during interpreter finalisation. Returns how many group
    references were dropped. Does nothing while the default group is initialised (the groups are in
    use) or when torch.distributed was never imported."""
    import sys

    dist = sys.modules.get("torch.distributed")
    mesh_mod = sys.modules.get("torch.distributed.device_mesh")
    if dist is None or mesh_mod is None or not dist.is_available() or dist.is_initialized():
        return 0
    mesh_type = getattr(mesh_mod, "DeviceMesh", None)
    if not isinstance(mesh_type, type):
        return 0
    dropped = 0
    for obj in gc.get_objects():  # meshes pinned by DTensor's caches are reachable only from there
        # the MRO, not isinstance: DeviceMesh's metaclass probes the object (torch's deprecated
        # aliases then warn, at exit)
        if mesh_type in type(obj).__mro__:
            registry = obj.__dict__.get("_pg_registry")
            if isinstance(registry, dict) and registry:
                dropped += len(registry)
                registry.clear()
    if dropped:
        gc.collect()
    return dropped


def destroy_process_group() -> None:
    """`torch.distributed.destroy_process_group()` followed by `release_process_groups()`: call it
    at the end of a DCP job that used DTensor / DeviceMesh instead of torch's alone."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    release_process_groups()


@atexit.register
def _release_at_exit() -> None:
    try:
        release_process_groups()
    except Exception:  # exiting anyway: never turn an exit into an error
        pass
