"""KVCache: LLM inference's context (KV) cache on threefs, shared by every client on every host.

    import threefs
    from threefs.kvcache import KVCache, page_keys

    fs = threefs.connect()
    cache = KVCache(fs, "/kvcache/llama-8b", page_bytes=1 << 20, capacity_bytes=64 << 30)
    keys = page_keys(token_ids, page_tokens=64, namespace="llama-8b/tp0of1")
    hits = cache.batch_exists(keys)                       # length of the cached prefix
    cache.batch_get_into(keys[:hits], buffers[:hits])     # bytes read per key (-1: miss), into your memory
    cache.batch_put(keys[hits:], pages)                   # [True, ...]: stored (or already there)

Data part: the pages live in large files in the cache root (`data-NNNN`), page `slot` at
`(slot % slots_per_file) * stride` with `stride` = the page size rounded up to a power of two; the files' chunk
size is max(stride, 1 MiB), so a page never straddles two chunks, a page of 1 MiB or more is one whole chunk,
and smaller pages written by one batch into adjacent slots share storage updates. Pages move with threefs
batch IO straight between storage and the caller's buffers.

Meta part: the kvcache service (threefs/kvcache/service.py) maps key -> (slot, length, crc32c, generation);
one round trip per batch. A put reserves fresh slots, writes them, then commits: a page is visible only when
completely written, and a reader checks the crc32c of what it read (a page reused under it reads as a miss).
"""

from __future__ import annotations

import concurrent.futures
import json
import secrets
import socket
import threading
import time

from threefs.common import crc32c
from threefs.common import local_socket
from threefs.common.spin import AnswerWait
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.kvcache import protocol

DISCOVER_WAIT_S = 15.0  # longer than the service checks its registration (service.REGISTRATION_CHECK_S)
from threefs.kvcache.index import BATCH_KEYS_MAX, EXISTS, RESERVED
from threefs.kvcache.service import SERVICE_FILE

CAP_READ = ".cap-read"
CAP_WRITE = ".cap-write"
FILE_BYTES_TARGET = 64 << 30  # data file size; a cache larger than this gets several files
PAGE_BYTES_DEFAULT = 1 << 20
CAPACITY_BYTES_DEFAULT = 16 << 30
STRIDE_BYTES_MIN = 4 << 10
# Data files' chunk size: the stride, or this when pages are smaller. Adjacent pages of one chunk written by one
# batch become one storage update (64 pages of 64 KiB: ~5 updates instead of 64; puts ~2x faster measured).
CHUNK_BYTES_DEFAULT = 1 << 20
STRIDE_BYTES_MAX = 64 << 20
TIMEOUT_S_DEFAULT = 30.0
READ_PART_IOS = 16  # pages per batch_read call of a get, at least
READ_PARTS_MAX = 4
_READ_OK, _READ_FAILED, _CRC_MISMATCH = 0, 1, 2


def stride_of(page_bytes: int) -> int:
    """The slot stride: page_bytes rounded up to a power of two (it is also the data files' chunk size)."""
    if not isinstance(page_bytes, int) or not 0 < page_bytes <= STRIDE_BYTES_MAX:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"page_bytes {page_bytes!r} must be an int in "
                           f"1..{STRIDE_BYTES_MAX}")
    return max(STRIDE_BYTES_MIN, 1 << (page_bytes - 1).bit_length())


def byte_view(buf, writable: bool) -> memoryview:
    """A flat byte view of bytes/bytearray/memoryview/numpy arrays/torch CPU tensors (no copy)."""
    if hasattr(buf, "data_ptr") and hasattr(buf, "is_contiguous"):  # a torch tensor
        import torch

        if buf.device.type != "cpu":
            raise status_error(StatusCode.INVALID_ARGUMENT, f"tensor on {buf.device}: pass CPU (host) tensors")
        if not buf.is_contiguous():
            raise status_error(StatusCode.INVALID_ARGUMENT, "tensor is not contiguous; pass t.contiguous()")
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(buf)
    except TypeError:
        raise status_error(StatusCode.INVALID_ARGUMENT, f"a page buffer must support the buffer protocol, "
                           f"not {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise status_error(StatusCode.INVALID_ARGUMENT, "page buffer is not contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise status_error(StatusCode.INVALID_ARGUMENT, "batch_get_into needs writable buffers (bytearray, "
                           "numpy array, tensor), not bytes")
    return view


class MetaConnection:
    """One blocking TCP connection to the kvcache service; reconnects (finding the service again through
    SERVICE_FILE) and retries until `timeout_s` when the service is restarting."""

    def __init__(self, fs, timeout_s: float = TIMEOUT_S_DEFAULT, addr: str | None = None):
        self.fs = fs
        self.timeout_s = timeout_s
        self._fixed_addr = addr
        self._sock: socket.socket | None = None
        self._answer: AnswerWait | None = None
        self._lock = threading.Lock()
        self._rid = 0
        self.addr = ""

    def _discover(self) -> str:
        if self._fixed_addr:
            return self._fixed_addr
        deadline = time.monotonic() + DISCOVER_WAIT_S
        while True:
            try:
                raw = self.fs.read_bytes(SERVICE_FILE)
            except FileNotFoundError:
                raise status_error(StatusCode.NOT_FOUND, f"no kvcache service in this cluster ({SERVICE_FILE} "
                                   "missing): `threefs up` starts one (kvcache-1)") from None
            try:
                return json.loads(raw)["addr"]
            except (ValueError, KeyError, TypeError):
                # The service checks its registration every few seconds and rewrites it when it is not
                # what it published (it logs what it found): wait for that, then say what is wrong.
                if time.monotonic() > deadline:
                    raise status_error(StatusCode.UNAVAILABLE, f"{SERVICE_FILE} does not name a kvcache "
                                       f"service ({len(raw)} bytes: {raw[:80]!r}); is kvcache-1 running? "
                                       "(see its log)") from None
                time.sleep(0.25)

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self.addr = self._discover()
            host, port = self.addr.rsplit(":", 1)
            # The service's Unix socket when it runs on this host (threefs/common/local_socket.py), else TCP. Python's
            # socket timeout waits in poll() before each recv, which also keeps a Unix socket's wake-up at
            # the server's read of the request from waking this thread (rpc/blocking.py).
            sock = local_socket.connect_blocking(self.addr, min(5.0, self.timeout_s))
            if sock is None:
                sock = socket.create_connection((host, int(port)), timeout=min(5.0, self.timeout_s))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout_s)
            self._answer = AnswerWait(sock.fileno())  # quick answers are waited for by spinning first
            self._sock = sock
        return self._sock

    def _close_socket(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def call(self, op: str, args: dict):
        deadline = time.monotonic() + self.timeout_s
        pause = 0.05
        while True:
            try:
                with self._lock:
                    sock = self._connect()
                    self._rid += 1
                    sock.sendall(protocol.encode([self._rid, op, args]))
                    if not self._answer.wait(int(self.timeout_s * 1000)):
                        raise TimeoutError(f"no answer within {self.timeout_s:.0f} s")
                    n = protocol.frame_length(protocol.recv_exact(sock, protocol.HEADER_BYTES))
                    rid, code, result = protocol.decode(protocol.recv_exact(sock, n))
                if code:
                    raise status_error(code, result)
                return result
            except ThreeFSError as exc:
                if exc.code not in (StatusCode.UNAVAILABLE,) or time.monotonic() > deadline:
                    raise
                last = exc
            except OSError as exc:  # refused, reset, timed out: the service is (re)starting
                last = exc
            with self._lock:
                self._close_socket()
            if time.monotonic() > deadline:
                raise status_error(StatusCode.UNAVAILABLE, f"kvcache service {self.addr or '?'} unreachable for "
                                   f"{self.timeout_s:.0f} s ({last}); `threefs status` shows kvcache-1, "
                                   "`threefs up` restarts it")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def close(self) -> None:
        with self._lock:
            self._close_socket()


class KVCache:
    """A context cache in `root` on threefs. Keys are bytes (see page_keys); a page is up to page_bytes bytes.

    Opening a root that exists takes its page size and capacity (pass the same values or 0). A client that
    can read the root's `.cap-write` may write, one that can read `.cap-read` may read: set the root's
    permissions (chmod/chown) before the first open, the capability files follow them.
    """

    def __init__(self, fs, root: str, page_bytes: int = PAGE_BYTES_DEFAULT,
                 capacity_bytes: int = CAPACITY_BYTES_DEFAULT, *, ttl_s: float = 0.0, verify: bool = True,
                 create: bool = True, timeout_s: float = TIMEOUT_S_DEFAULT, service_addr: str | None = None,
                 chunk_bytes: int = CHUNK_BYTES_DEFAULT):
        if not isinstance(root, str) or not root.startswith("/"):
            raise status_error(StatusCode.INVALID_ARGUMENT, f"cache root {root!r} must be an absolute path")
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.verify = verify
        self._meta = MetaConnection(fs, timeout_s, service_addr)
        self._cap, self.writable = self._capability(create)
        info = self._meta.call("open", {"root": self.root, "page_bytes": page_bytes, "capacity_bytes": capacity_bytes,
                                        "ttl_s": ttl_s, "cap": self._cap})
        self.cache_id = info["cache"]
        self.lease_s = float(info.get("lease_s", 120.0))
        self.page_bytes = info["page_bytes"]
        self.slots = info["slots"]
        self.capacity_bytes = self.slots * self.page_bytes
        self.stride = stride_of(self.page_bytes)
        self.chunk_bytes = max(self.stride, chunk_bytes)  # for new data files (existing ones keep theirs)
        self.slots_per_file = max(1, FILE_BYTES_TARGET // self.stride)
        self._files = self._open_data_files()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.counters = {"bytes_read": 0, "bytes_written": 0, "crc_mismatches": 0, "read_errors": 0,
                         "write_errors": 0}

    # -- set-up ----------------------------------------------------------------------------------
    def _read_cap(self, name: str) -> str:
        return self.fs.read_bytes(f"{self.root}/{name}").decode().strip()

    def _capability(self, create: bool) -> tuple[str, bool]:
        for attempt in range(2):
            try:
                return self._read_cap(CAP_WRITE), True
            except PermissionError:
                try:
                    return self._read_cap(CAP_READ), False
                except PermissionError:
                    raise status_error(StatusCode.PERMISSION_DENIED, f"kvcache {self.root}: no permission to "
                                       f"read or write it (threefs permissions on {self.root})") from None
            except FileNotFoundError:
                if not create or attempt:
                    raise status_error(StatusCode.NOT_FOUND, f"no kvcache at {self.root} (KVCache(fs, root) with "
                                       "create=True makes one)") from None
                self._create_caps()
        raise AssertionError("unreachable")

    def _create_caps(self) -> None:
        self.fs.mkdir(self.root, 0o755, parents=True, exist_ok=True)
        mode = self.fs.stat(self.root).mode & 0o777
        # who may read `.cap-read`: who may read the root; who may read `.cap-write`: who may write it
        for name, perm in ((CAP_READ, mode & 0o444), (CAP_WRITE, (mode & 0o222) << 1)):
            tmp = f"{self.root}/{name}.{secrets.token_hex(4)}.tmp"
            self.fs.write_bytes(tmp, secrets.token_hex(32).encode())
            self.fs.chmod(tmp, perm | 0o400)
            try:
                self.fs.rename(tmp, f"{self.root}/{name}", noreplace=True)
            except FileExistsError:  # another client made it first: theirs counts
                self.fs.remove(tmp)

    def _open_data_files(self) -> list:
        files = []
        n_files = -(-self.slots // self.slots_per_file)
        mode = (self.fs.stat(self.root).mode & 0o666) | 0o600
        for i in range(n_files):
            path = f"{self.root}/data-{i:04d}"
            length = min(self.slots_per_file, self.slots - i * self.slots_per_file) * self.stride
            if self.writable:
                with self.fs.open(path, "ab", buffering=0, chunk_size=self.chunk_bytes, perm=mode):
                    pass  # created with the page-sized chunks, or opened for writing: permission checked
                if self.fs.stat(path).length < length:
                    self.fs.truncate(path, length)  # sparse: no chunk exists until a page is written
            else:
                with self.fs.open(path, "rb", buffering=0):
                    pass
            attr = self.fs.stat(path)
            if attr.layout.chunk_size % self.stride:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"{path} has chunk size {attr.layout.chunk_size}, "
                                   f"not a multiple of the cache's stride {self.stride}; it was not made by KVCache")
            files.append(attr)
        return files

    def _where(self, slot: int) -> tuple[object, int]:
        f, s = divmod(slot, self.slots_per_file)
        return self._files[f], s * self.stride

    def _call(self, op: str, **args):
        return self._meta.call(op, {"cache": self.cache_id, "cap": self._cap, **args})

    # -- the API ---------------------------------------------------------------------------------
    def batch_put(self, keys: list[bytes], buffers: list) -> list[bool]:
        """Store pages; True per key once it is in the cache (written now or already there), False when
        there was no room (every slot reserved by puts in flight) or the write failed."""
        _check_pairs(keys, buffers)
        if not self.writable:
            raise status_error(StatusCode.PERMISSION_DENIED, f"kvcache {self.root} is open read-only for this "
                               "client (threefs permissions on the root)")
        out: list[bool] = []
        for i in range(0, len(keys), BATCH_KEYS_MAX):
            out += self._put(list(keys[i:i + BATCH_KEYS_MAX]), buffers[i:i + BATCH_KEYS_MAX])
        return out

    def _put(self, keys: list[bytes], buffers: list) -> list[bool]:
        views = [byte_view(b, writable=False) for b in buffers]
        for v in views:
            if not 0 < len(v) <= self.page_bytes:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"page of {len(v)} bytes: pages of "
                                   f"{self.root} hold 1..{self.page_bytes} bytes")
        reserved = self._call("reserve", keys=keys, lengths=[len(v) for v in views])
        out = [outcome == EXISTS for outcome, _, _ in reserved]
        todo = [(i, slot, gen) for i, (outcome, slot, gen) in enumerate(reserved) if outcome == RESERVED]
        if not todo:
            return out
        items = []
        for i, slot, _ in todo:
            attr, offset = self._where(slot)
            items.append((attr, offset, views[i]))
        try:
            results = self.fs.batch_write(items, raise_on_error=False)
        except ThreeFSError as exc:  # the whole call failed (publishing the lengths): nothing is committed
            results = [exc] * len(items)
        commits, aborts, committed_at = [], [], []
        for (i, slot, gen), r in zip(todo, results):
            if isinstance(r, BaseException) or r != len(views[i]):
                aborts.append((slot, gen))
                self.counters["write_errors"] += 1
            else:
                commits.append((keys[i], slot, gen, len(views[i]), crc32c.crc32c(views[i])))
                committed_at.append(i)
                self.counters["bytes_written"] += len(views[i])
        done = self._call("commit", items=commits, aborts=aborts)
        for i, ok in zip(committed_at, done):
            out[i] = bool(ok)
        return out

    def batch_get_into(self, keys: list[bytes], buffers: list) -> list[int]:
        """Read pages straight into the caller's buffers; bytes read per key, -1 for a miss (absent, or a page
        that did not read back whole and correct)."""
        _check_pairs(keys, buffers)
        out: list[int] = []
        for i in range(0, len(keys), BATCH_KEYS_MAX):
            out += self._get(list(keys[i:i + BATCH_KEYS_MAX]), buffers[i:i + BATCH_KEYS_MAX])
        return out

    def _get(self, keys: list[bytes], buffers: list) -> list[int]:
        views = [byte_view(b, writable=True) for b in buffers]
        found = self._call("lookup", keys=keys, touch=True, count="get")
        out = [-1] * len(keys)
        hits, items = [], []
        for i, e in enumerate(found):
            if e is None:
                continue
            slot, length, crc, gen = e
            if len(views[i]) < length:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"buffer {i} holds {len(views[i])} bytes; the "
                                   f"page of key {i} has {length}")
            attr, offset = self._where(slot)
            items.append((attr, offset, length, views[i]))
            hits.append((i, length, crc, gen))
        if not items:
            return out
        verdicts = self._read_checked(items, [h[2] for h in hits])
        bad = []
        for (i, length, crc, gen), verdict in zip(hits, verdicts):
            if verdict == _READ_FAILED:
                self.counters["read_errors"] += 1
            elif verdict == _CRC_MISMATCH:
                self.counters["crc_mismatches"] += 1
                bad.append((keys[i], gen))
            else:
                out[i] = length
                self.counters["bytes_read"] += length
        if bad:
            self._call("invalidate", items=bad)
        return out

    def _read_part(self, items: list, crcs: list[int]) -> list[int]:
        """batch_read of (attr, offset, length, view) items, then each page's crc32c: a verdict per item."""
        try:
            results = self.fs.batch_read(items, raise_on_error=False)
        except ThreeFSError as exc:  # the whole call failed: every page of it is a miss
            results = [exc] * len(items)
        out = []
        for (_, _, length, view), r, crc in zip(items, results, crcs):
            if isinstance(r, BaseException) or r != length:
                out.append(_READ_FAILED)
            elif self.verify and crc32c.crc32c(view[:length]) != crc:
                out.append(_CRC_MISMATCH)
            else:
                out.append(_READ_OK)
        return out

    def _read_checked(self, items: list, crcs: list[int]) -> list[int]:
        """Reads of a big batch go out as up to READ_PARTS_MAX batch_read calls at once, from threads: the
        checksums of one part (crc32c releases the GIL) overlap the receiving of the others, and a call's small
        IOs (< 128 KiB) share requests to one storage service, so one call would keep one service busy."""
        if len(items) <= READ_PART_IOS:
            return self._read_part(items, crcs)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(READ_PARTS_MAX, thread_name_prefix="kvcache-read")
        step = max(READ_PART_IOS, -(-len(items) // READ_PARTS_MAX))
        futures = [self._pool.submit(self._read_part, items[i:i + step], crcs[i:i + step])
                   for i in range(0, len(items), step)]
        return [v for f in futures for v in f.result()]

    def batch_exists(self, keys: list[bytes]) -> int:
        """How many keys from the start are in the cache (the cached prefix, in pages)."""
        n = 0
        for i in range(0, len(keys), BATCH_KEYS_MAX):
            part = list(keys[i:i + BATCH_KEYS_MAX])
            found = self._call("lookup", keys=part, touch=True, prefix=True, count="exists")
            run = next((j for j, e in enumerate(found) if e is None), len(found))
            n += run
            if run < len(part):
                break
        return n

    def delete(self, keys: list[bytes]) -> int:
        """Remove keys; returns how many were present."""
        n = 0
        for i in range(0, len(keys), BATCH_KEYS_MAX):
            n += self._call("remove", keys=list(keys[i:i + BATCH_KEYS_MAX]))
        return n

    def clear(self, drop: bool = False) -> int:
        """Remove every entry (the files stay, their space is reused). drop=True also forgets the cache in
        the service (its page size and capacity; the next open makes it anew) and removes the data files."""
        n = self._call("clear", drop=drop)
        if drop:
            for name in self.fs.listdir(self.root):
                if name.startswith("data-") or name in (CAP_READ, CAP_WRITE):
                    self.fs.remove(f"{self.root}/{name}")
        return n

    def stats(self) -> dict:
        """The service's figures for this cache (pages, used/capacity bytes, hit rate, evictions, ...) and this
        client's bytes moved."""
        return {**self._call("stats"), "client": dict(self.counters)}

    def close(self) -> None:
        self._meta.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_pairs(keys, buffers) -> None:
    if len(keys) != len(buffers):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(buffers)} buffers")


def service_call(fs, op: str, args: dict | None = None, timeout_s: float = 10.0):
    """One call to the cluster's kvcache service (the CLI's `ls`/`stats`)."""
    conn = MetaConnection(fs, timeout_s)
    try:
        return conn.call(op, args or {})
    finally:
        conn.close()

