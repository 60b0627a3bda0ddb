"""CheckpointManager: save a state dict in seconds, load it with one batch read.

    import threefs
    from threefs.checkpoint import CheckpointManager

    fs = threefs.connect()
    ckpt = CheckpointManager(fs, "/ckpt/run1", keep_last=3, keep_every=1000)
    fut = ckpt.async_save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 100}, step=100)
    ...                                   # training continues; fut.result() raises if the save failed
    state = ckpt.load()                   # the newest complete step; load(step, prefixes=["model"])

Save: every tensor is copied into one reusable host buffer laid out as the data file (the snapshot:
the only time the caller waits in async_save), then written with batch writes of chunk-aligned
pieces, many in flight, striped over all chains; then the index; then the directory is renamed
from `.partial-step-N-TOKEN` to `step-N` (one metadata transaction): a checkpoint is complete
exactly when it is visible, a crash at any point before leaves only a hidden partial directory,
and older steps are never touched until retention removes them after the new one is published.

Distributed (torch.distributed initialised, world size > 1): every rank writes its own data file
into the same partial directory; rank 0 publishes after all ranks report success (over a gloo
group of the manager's own, so an async save does not collide with training collectives).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from threefs.checkpoint import format as fmt
from threefs.checkpoint import tensor_io
from threefs.common import limits
from threefs.common.status import StatusCode, status_error

CHUNK_SIZE_DEFAULT = 4 * limits.MiB  # checkpoint files are written and read in big pieces
STEP_RE = re.compile(r"^step-(\d+)$")
PARTIAL_PREFIX = ".partial-"
WHOLE_FILE_LOAD = True  # a whole load reads each data file in whole chunks (see load); False: per tensor


def step_dir_name(step: int) -> str:
    return f"step-{step:010d}"


class CheckpointManager:
    def __init__(self, client, root: str, *, keep_last: int | None = None, keep_every: int | None = None,
                 chunk_size: int = CHUNK_SIZE_DEFAULT, stripe: int = 0,
                 piece_bytes: int = tensor_io.PIECE_BYTES_DEFAULT, verify: bool = True, group=None):
        if keep_last is not None and keep_last < 1:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"keep_last must be >= 1 (got {keep_last})")
        if keep_every is not None and keep_every < 1:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"keep_every must be >= 1 (got {keep_every})")
        self.client = client
        self.root = "/" + root.strip("/") if root.strip("/") else "/"
        self.keep_last, self.keep_every = keep_last, keep_every
        self.chunk_size, self.stripe, self.piece_bytes = chunk_size, stripe, piece_bytes
        self.verify_on_load = verify
        self.rank, self.world_size, self._group = _dist_info(group)
        self._staging = tensor_io.Staging()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._lock = threading.Lock()
        self.last_save: dict[str, float] = {}  # seconds of each phase of the newest save, and bytes

    # -- paths -----------------------------------------------------------------------------------
    def path_of(self, step: int) -> str:
        return f"{self.root.rstrip('/')}/{step_dir_name(step)}"

    def steps(self) -> list[int]:
        """Published (complete) steps, oldest first."""
        try:
            names = self.client.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(mt.group(1)) for n in names if (mt := STEP_RE.match(n)))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def partial(self) -> list[str]:
        """Directories of saves that never published (crashed, or still running elsewhere)."""
        try:
            return sorted(n for n in self.client.listdir(self.root) if n.startswith(PARTIAL_PREFIX))
        except FileNotFoundError:
            return []

    def clean_partial(self) -> list[str]:
        """Remove every partial directory. Only when no save of this root is running anywhere."""
        gone = self.partial()
        for n in gone:
            self.client.remove_tree(f"{self.root.rstrip('/')}/{n}")
        return gone

    # -- save ------------------------------------------------------------------------------------
    def save(self, state, step: int, *, user_meta: dict[str, str] | None = None,
             overwrite: bool = False) -> str:
        """Save `state` as `step`; returns the published directory. Waits for an async save in flight."""
        self.wait()
        return self._write_and_publish(self._snapshot_or_error(state, step), step, user_meta or {}, overwrite)

    def async_save(self, state, step: int, *, user_meta: dict[str, str] | None = None,
                   overwrite: bool = False) -> Future:
        """Snapshot `state` to host memory now, write it in the background. Returns a Future of the
        published path (its exception if the save failed). At most one save is in flight: a second
        call first waits for the previous one to finish (bounding host memory to one snapshot)."""
        self.wait()
        snap = self._snapshot_or_error(state, step)
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="threefs-ckpt")
            fut = self._executor.submit(self._write_and_publish, snap, step, user_meta or {}, overwrite)
            self._inflight = fut
        return fut

    def _snapshot_or_error(self, state, step: int):
        """The snapshot; with several ranks a failure is carried along instead of raised, so this
        rank still takes part in the collectives and every rank fails together."""
        try:
            return self._snapshot(state, step)
        except BaseException as e:
            if self.world_size == 1:
                raise
            return e

    def wait(self) -> None:
        """Wait for the save in flight, if any (its errors stay with its future)."""
        with self._lock:
            fut = self._inflight
        if fut is not None:
            fut.exception()

    def _data_file(self) -> str:
        return f"data-r{self.rank:05d}.bin"

    def _snapshot(self, state, step: int) -> tensor_io.Snapshot:
        if not isinstance(step, int) or step < 0:
            raise status_error(StatusCode.INVALID_ARGUMENT, f"step must be an int >= 0 (got {step!r})")
        t0 = time.perf_counter()
        snap = tensor_io.snapshot(state, self._staging, self._data_file())
        self.last_save = {"snapshot_s": time.perf_counter() - t0, "bytes": float(len(snap.buf))}
        return snap

    def _write_and_publish(self, snap, step: int, user_meta: dict[str, str], overwrite: bool) -> str:
        # Every rank runs every collective below whatever fails, or the others would wait forever.
        final = self.path_of(step)
        error = snap if isinstance(snap, BaseException) else None
        if error is None and not overwrite and self.rank == 0 and self.client.exists(final):
            error = status_error(StatusCode.EXISTS, f"{final} already exists; pass overwrite=True to replace it")
        token = self._agree(uuid.uuid4().hex[:12])
        tmp = f"{self.root.rstrip('/')}/{PARTIAL_PREFIX}{step_dir_name(step)}-{token}"
        if error is None:
            try:
                self._write_part(snap, tmp)
            except BaseException as e:
                error = e
        errors = self._gather_errors(error)
        if errors:
            if error is not None:
                raise error
            raise status_error(StatusCode.INTERNAL, f"checkpoint step {step} not published: {errors[0]}")
        t0 = time.perf_counter()
        result = None
        if self.rank == 0:
            try:
                self._publish(tmp, final, step, user_meta, overwrite)
                self._retain()
            except BaseException as e:
                result = e
        result = self._broadcast_error(result)
        self.last_save["publish_s"] = time.perf_counter() - t0
        if result is not None:
            if isinstance(result, BaseException):
                raise result
            raise status_error(StatusCode.INTERNAL, f"checkpoint step {step} not published: {result}")
        return final

    def _write_part(self, snap: tensor_io.Snapshot, tmp: str) -> None:
        """This rank's data file and rank index, into the partial directory."""
        t0 = time.perf_counter()
        self.client.mkdir(tmp, parents=True, exist_ok=True, chunk_size=self.chunk_size, stripe=self.stripe)
        tensor_io.checksum_all(snap.buf, snap.entries)
        t1 = time.perf_counter()
        tensor_io.write_pieces(self.client, f"{tmp}/{self._data_file()}", snap.buf, self.chunk_size,
                               self.piece_bytes)
        self.client.write_bytes(f"{tmp}/rank-{self.rank:05d}.msgpack",
                                fmt.encode_index_part(fmt.RankIndex(snap.tree, snap.entries)))
        self.last_save.update(checksum_s=t1 - t0, write_s=time.perf_counter() - t1)

    def _publish(self, tmp: str, final: str, step: int, user_meta: dict[str, str], overwrite: bool) -> None:
        ranks = [fmt.decode_index_part(self.client.read_bytes(f"{tmp}/rank-{r:05d}.msgpack"), tmp)
                 for r in range(self.world_size)]
        index = fmt.Index(fmt.FORMAT, fmt.VERSION, step, time.time(), ranks, dict(user_meta))
        self.client.write_bytes(f"{tmp}/{fmt.INDEX_NAME}", fmt.encode_index(index))
        if overwrite and self.client.exists(final):
            trash = f"{self.root.rstrip('/')}/{PARTIAL_PREFIX}replaced-{uuid.uuid4().hex[:12]}"
            self.client.rename(final, trash)
            self.client.rename(tmp, final, noreplace=True)
            self.client.remove_tree(trash)
        else:
            self.client.rename(tmp, final, noreplace=True)  # the publish: one metadata transaction

    def _retain(self) -> None:
        if self.keep_last is None:
            return
        steps = self.steps()
        keep = set(steps[-self.keep_last:])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        for s in steps:
            if s not in keep:
                self.client.remove_tree(self.path_of(s))

    # -- load ------------------------------------------------------------------------------------
    def index(self, step: int | None = None) -> fmt.Index:
        step = self.resolve_step(step)
        path = self.path_of(step)
        try:
            data = self.client.read_bytes(f"{path}/{fmt.INDEX_NAME}")
        except FileNotFoundError:
            raise status_error(StatusCode.NOT_FOUND, f"{path}: no checkpoint index (not a checkpoint "
                               "directory, or damaged)") from None
        return fmt.decode_index(data, path)

    def resolve_step(self, step: int | None) -> int:
        """step itself, or the newest complete step when None (NOT_FOUND if there is none)."""
        if step is not None:
            return step
        latest = self.latest_step()
        if latest is None:
            raise status_error(StatusCode.NOT_FOUND, f"no complete checkpoint under {self.root}")
        return latest

    def load(self, step: int | None = None, *, names=None, prefixes=None, map_location=None,
             verify: bool | None = None, into=None, rank: int | None = None):
        """Load step (default: the newest complete one) as the saved tree. names/prefixes select
        tensors and values by dotted name ("model.layers.0.weight", prefix "model"); `into` is a
        state dict whose tensors are read into in place where dtype and shape match (contiguous CPU
        tensors receive the bytes straight from storage). map_location moves loaded torch tensors
        ("cuda:0", torch.device). verify checks every tensor's crc32c (default: the manager's).

        A whole load (no names/prefixes/into) reads each data file into one fresh host buffer in
        whole chunks; the tensors are views of their bytes of it (each its own torch storage), and the
        buffer is freed when the last of them is."""
        step = self.resolve_step(step)
        index = self.index(step)
        return load_index(self.client, self.path_of(step), index,
                          self.rank if rank is None else rank, names=names, prefixes=prefixes,
                          map_location=map_location, verify=self.verify_on_load if verify is None else verify,
                          into=into)

    def verify(self, step: int | None = None, group_bytes: int = 512 * limits.MiB) -> list[str]:
        """Read every tensor of every rank and check its crc32c, group_bytes at a time (memory stays
        bounded for checkpoints bigger than RAM). Returns one line per damaged tensor (empty: intact)."""
        step = self.resolve_step(step)
        path, index = self.path_of(step), self.index(step)
        attrs = {}
        problems, group, size = [], [], 0

        def flush():
            try:
                tensor_io.read_into(self.client, group, True, path)
            except OSError:  # find which ones, one at a time
                for item in group:
                    try:
                        tensor_io.read_into(self.client, [item], True, path)
                    except OSError as e:
                        problems.append(f"rank {item[3]} {item[0].name}: {e}")
            group.clear()

        for rank, e in index.all_tensors():
            if e.file not in attrs:
                try:
                    attrs[e.file] = self.client.stat(f"{path}/{e.file}")
                except FileNotFoundError:
                    attrs[e.file] = None
            if attrs[e.file] is None:
                problems.append(f"rank {rank} {e.name}: data file {e.file} is missing")
                continue
            group.append((e, attrs[e.file], tensor_io.empty_like_entry(e), rank))
            size += e.nbytes
            if size >= group_bytes:
                flush()
                size = 0
        flush()
        return problems

    def remove(self, step: int) -> None:
        path = self.path_of(step)
        if not self.client.exists(path):
            raise status_error(StatusCode.NOT_FOUND, f"{path}: no such checkpoint")
        self.client.remove_tree(path)

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        self._staging.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- distributed coordination ----------------------------------------------------------------
    def _agree(self, token: str) -> str:
        if self.world_size == 1:
            return token
        import torch.distributed as dist

        box = [token]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _gather_errors(self, error: BaseException | None) -> list[str]:
        mine = None if error is None else f"rank {self.rank}: {type(error).__name__}: {error}"
        if self.world_size == 1:
            return [mine] if mine else []
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, mine, group=self._group)
        return [e for e in out if e]

    def _broadcast_error(self, result):
        if self.world_size == 1:
            return result
        import torch.distributed as dist

        box = [None if result is None else f"{type(result).__name__}: {result}"]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return result if self.rank == 0 else box[0]


def _dist_info(group) -> tuple[int, int, Any]:
    try:
        import torch.distributed as dist
    except ImportError:
        return 0, 1, None
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, None
    world = dist.get_world_size()
    if world == 1:
        return 0, 1, None
    if group is None:  # a group of our own: background saves must not interleave with training's
        group = dist.new_group(backend="gloo")
    return dist.get_rank(), world, group


def load_index(client, path: str, index: fmt.Index, rank: int, *, names=None, prefixes=None,
               map_location=None, verify: bool = True, into=None):
    """Load rank `rank`'s tree of a checkpoint whose index is already read (see CheckpointManager.load)."""
    if not 0 <= rank < len(index.ranks):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: rank {rank} not in checkpoint "
                           f"(saved by {len(index.ranks)} ranks)")
    part = index.ranks[rank]
    wanted = fmt.selector(names, prefixes)
    _check_selection(part, names, prefixes, path)
    dests = {}
    if into is not None:
        enc = fmt.TreeEncoder()
        enc.encode(into)
        dests = dict(enc.tensors)
    attrs: dict[str, Any] = {}
    loaded: dict[int, Any] = {}
    if WHOLE_FILE_LOAD and into is None and names is None and prefixes is None:  # whole files, whole chunks
        by_file: dict[str, list[int]] = {}
        for i, e in enumerate(part.tensors):
            by_file.setdefault(e.file, []).append(i)
        for file, idx in by_file.items():
            attr = client.stat(f"{path}/{file}")
            got = tensor_io.read_file_whole(client, attr, [part.tensors[i] for i in idx], verify, path)
            loaded.update(zip(idx, got))
    reads, copies, fresh = [], [], set()
    for i, e in enumerate(part.tensors):
        if i in loaded:
            continue
        if not wanted(e.name):
            continue
        if e.file not in attrs:
            attrs[e.file] = client.stat(f"{path}/{e.file}")
        dest = dests.get(e.name)
        if dest is not None and not tensor_io.matches(e, dest):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"{path}: tensor {e.name!r} is {e.dtype} "
                               f"{e.shape} in the checkpoint but {_describe(dest)} in `into`")
        target = dest if dest is not None and tensor_io.byte_view(dest) is not None else None
        if target is None:
            target = tensor_io.empty_like_entry(e, back=False)
            fresh.add(id(target))
            if dest is not None:
                copies.append((dest, target))
        reads.append((e, attrs[e.file], target))
        loaded[i] = dest if dest is not None else target
    tensor_io.read_into(client, reads, verify, path, back=fresh)
    for dest, tmp in copies:
        dest.copy_(tmp) if hasattr(dest, "copy_") else dest.__setitem__(Ellipsis, tmp)
    moved = _mover(map_location)

    def leaf(tag, i, name):
        if i not in loaded:
            return fmt.SKIP
        return moved(loaded[i])

    out = fmt.decode_tree(part.tree, leaf, None if names is None and prefixes is None else wanted)
    return {} if out is fmt.SKIP else out


def _check_selection(part: fmt.RankIndex, names, prefixes, path: str) -> None:
    all_names = [n for n, _ in fmt.tree_leaf_names(part.tree)]
    for n in names or ():
        if n not in all_names:
            near = [x for x in all_names if x.startswith(n.split(".")[0])][:5]
            raise status_error(StatusCode.NOT_FOUND, f"{path}: no tensor or value named {n!r}"
                               + (f" (similar: {', '.join(near)})" if near else ""))
    for p in prefixes or ():
        sel = fmt.selector(None, [p])
        if not any(sel(x) for x in all_names):
            raise status_error(StatusCode.NOT_FOUND, f"{path}: nothing is named {p!r} or under it")


def _describe(t) -> str:
    return f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}"


def _mover(map_location):
    if map_location is None or str(map_location) == "cpu":
        return lambda t: t
    import torch

    device = torch.device(map_location)

    def move(t):
        return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

    return move
