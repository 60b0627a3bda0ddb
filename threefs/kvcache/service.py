"""The kvcache meta service: key -> slot for every cache, shared by all clients, durable in SQLite.

`threefs up` starts it as `kvcache-1` (`python -m threefs.server conf/kvcache-1.toml`, type "kvcache").
It listens on its own port, publishes its address in the file system (`/.kvcache/service.json`, so a
client on any host finds it with nothing but its threefs client config), and keeps:

    DIR/kvcache/index.db   SQLite (WAL): caches, committed entries, open reservations

Every request that changes an index is one SQLite transaction, committed before the answer is sent: an
acknowledged commit survives kill -9 of the service (WAL, synchronous=NORMAL: a power loss may lose the
last commits, a process crash does not). Access times are written back once a second (LRU order after a
crash is at most a second stale). Reservations are persisted too, so a restart never hands a slot that a
client may still be writing to another writer before its lease ends.

Who may do what: a request carries the cache's read or write capability, two random secrets kept in files
in the cache root (`.cap-read`, `.cap-write`) whose threefs permissions follow the root's; the service reads
them with the cluster token and compares. So threefs permissions on the root decide who may read or write.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import time

from threefs.common import local_socket
from threefs.common.status import StatusCode, ThreeFSError, status_error
from threefs.kvcache import protocol
from threefs.kvcache.index import CacheIndex, Entry, Reservation

log = logging.getLogger("threefs.kvcache")

SERVICE_DIR = "/.kvcache"
SERVICE_FILE = "/.kvcache/service.json"
# A reservation not committed by then frees its slot (the client died). Clients stop writing a batch whose
# reservation is older than half of it, and their storage calls time out well before (30 s).
LEASE_S_DEFAULT = 120.0
FLUSH_INTERVAL_S = 1.0
REGISTRATION_CHECK_S = 5.0  # how often the service checks that SERVICE_FILE still names it
CONNECTIONS_MAX = 1024
SLOTS_MAX = 1 << 32
PAGE_BYTES_MAX = 64 << 20  # a page is one chunk of the data files

_SCHEMA = """
create table if not exists caches(cache_id integer primary key, root text unique not null,
    page_bytes integer not null, slots integer not null, ttl_s real not null, next_gen integer not null,
    counters text not null default '{}');
create table if not exists entries(cache_id integer not null, key blob not null, slot integer not null,
    length integer not null, crc integer not null, gen integer not null, atime real not null,
    primary key(cache_id, key));
create table if not exists reservations(cache_id integer not null, slot integer not null, key blob not null,
    gen integer not null, deadline real not null, primary key(cache_id, slot));
"""


_SQL = {
    "put": "insert or replace into entries values (?,?,?,?,?,?,?)",
    "del": "delete from entries where cache_id=? and key=?",
    "res": "insert or replace into reservations values (?,?,?,?,?)",
    "unres": "delete from reservations where cache_id=? and slot=?",
}


def _row(cid: int, op: tuple) -> tuple:
    if op[0] == "put":
        e = op[2]
        return (cid, op[1], e.slot, e.length, e.crc, e.gen, e.atime)
    if op[0] == "res":
        r = op[2]
        return (cid, op[1], r.key, r.gen, r.deadline)
    return (cid, op[1])


def _runs(cid: int, journal: list) -> list[tuple[str, list[tuple]]]:
    """The journal as runs of one kind of change, in order (a delete and a later put of a key stay ordered)."""
    runs: list[tuple[str, list[tuple]]] = []
    for op in journal:
        if not runs or runs[-1][0] != op[0]:
            runs.append((op[0], []))
        runs[-1][1].append(_row(cid, op))
    return runs


class IndexStore:
    """The SQLite file behind the indexes (one writer: the service's event loop thread)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("pragma journal_mode=wal")
        self.db.execute("pragma synchronous=normal")
        self.db.executescript(_SCHEMA)

    def load(self) -> list[CacheIndex]:
        out = []
        for cid, root, page_bytes, slots, ttl_s, next_gen, counters in self.db.execute(
                "select cache_id, root, page_bytes, slots, ttl_s, next_gen, counters from caches"):
            idx = CacheIndex(cid, root, page_bytes, slots, ttl_s, next_gen=next_gen)
            for k, v in json.loads(counters).items():
                if hasattr(idx.counters, k):
                    setattr(idx.counters, k, v)
            used = set()
            for key, slot, length, crc, gen, atime in self.db.execute(
                    "select key, slot, length, crc, gen, atime from entries where cache_id=? order by atime, gen",
                    (cid,)):
                idx.entries[bytes(key)] = Entry(slot, length, crc, gen, atime)
                idx.used_bytes += length
                used.add(slot)
            for slot, key, gen, deadline in self.db.execute(
                    "select slot, key, gen, deadline from reservations where cache_id=?", (cid,)):
                idx.reserved[slot] = Reservation(bytes(key), gen, deadline)
                used.add(slot)
            idx.hwm = max(used) + 1 if used else 0
            idx.free.extend(s for s in range(idx.hwm) if s not in used)
            idx.next_gen = max([idx.next_gen] + [e.gen + 1 for e in idx.entries.values()]
                               + [r.gen + 1 for r in idx.reserved.values()])
            out.append(idx)
        return out

    def create(self, root: str, page_bytes: int, slots: int, ttl_s: float) -> int:
        cur = self.db.execute("insert into caches(root, page_bytes, slots, ttl_s, next_gen) values (?,?,?,?,1)",
                              (root, page_bytes, slots, ttl_s))
        return cur.lastrowid

    def persist(self, idx: CacheIndex, with_atimes: bool = False) -> None:
        """Write the index's journal (and optionally dirty access times and counters) in one transaction."""
        journal, idx.journal = idx.journal, []
        dirty = idx.dirty_atime if with_atimes else set()
        if not journal and not dirty and not with_atimes:
            return
        cid = idx.cache_id
        db = self.db
        db.execute("begin")
        try:
            for kind, rows in _runs(cid, journal):  # consecutive changes of one kind: one executemany
                db.executemany(_SQL[kind], rows)
            if dirty:
                db.executemany("update entries set atime=? where cache_id=? and key=?",
                               [(idx.entries[k].atime, cid, k) for k in dirty if k in idx.entries])
                dirty.clear()
            if with_atimes:
                db.execute("update caches set next_gen=?, counters=? where cache_id=?",
                           (idx.next_gen, json.dumps(idx.counters.__dict__), cid))
            else:
                db.execute("update caches set next_gen=? where cache_id=?", (idx.next_gen, cid))
            db.execute("commit")
        except BaseException:
            db.execute("rollback")
            idx.journal[:0] = journal  # nothing of it was written: try again with the next request
            raise

    def drop(self, cache_id: int) -> None:
        self.db.execute("begin")
        for table in ("entries", "reservations", "caches"):
            self.db.execute(f"delete from {table} where cache_id=?", (cache_id,))
        self.db.execute("commit")

    def close(self) -> None:
        self.db.close()


class KVCacheService:
    def __init__(self, store: IndexStore, read_caps=None, lease_s: float = LEASE_S_DEFAULT,
                 clock=time.time):
        self.store = store
        self.lease_s = lease_s
        self.clock = clock
        self.read_caps = read_caps  # async (root) -> (read cap, write cap): reads the cap files on threefs
        self.by_root: dict[str, CacheIndex] = {}
        self.by_id: dict[int, CacheIndex] = {}
        self.caps: dict[int, tuple[str, str]] = {}
        for idx in store.load():
            self.by_root[idx.root] = idx
            self.by_id[idx.cache_id] = idx

    # -- access ----------------------------------------------------------------------------------
    def _cache(self, args: dict, write: bool) -> CacheIndex:
        idx = self.by_id.get(args.get("cache"))
        if idx is None:
            raise status_error(StatusCode.NOT_FOUND, f"no kvcache with id {args.get('cache')!r} (dropped? "
                               "open it again)")
        caps = self.caps.get(idx.cache_id)
        cap = args.get("cap", "")
        if caps is None:
            raise status_error(StatusCode.PERMISSION_DENIED, f"kvcache {idx.root}: open it first")
        if cap != caps[1] and (write or cap != caps[0]):
            raise status_error(StatusCode.PERMISSION_DENIED, f"kvcache {idx.root}: this client may not "
                               f"{'write' if write else 'read'} it (threefs permissions on {idx.root})")
        return idx

    async def op_open(self, args: dict) -> dict:
        root = args["root"]
        page_bytes, capacity = int(args["page_bytes"]), int(args["capacity_bytes"])
        if self.read_caps is not None:
            read_cap, write_cap = await self.read_caps(root)
        else:
            read_cap, write_cap = args.get("cap", ""), args.get("cap", "")
        cap = args.get("cap", "")
        access = "rw" if cap == write_cap else "r" if cap == read_cap else ""
        if not access:
            raise status_error(StatusCode.PERMISSION_DENIED, f"kvcache {root}: the capability presented does "
                               "not match the cache's (.cap-read/.cap-write in the root)")
        idx = self.by_root.get(root)
        if idx is None:
            if not 0 < page_bytes <= PAGE_BYTES_MAX:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"page_bytes {page_bytes} must be in "
                                   f"1..{PAGE_BYTES_MAX} to create kvcache {root}")
            if access != "rw":
                raise status_error(StatusCode.NOT_FOUND, f"no kvcache at {root} (a writer creates it)")
            slots = capacity // page_bytes
            if not 1 <= slots <= SLOTS_MAX:
                raise status_error(StatusCode.INVALID_ARGUMENT, f"capacity {capacity} B holds {slots} pages of "
                                   f"{page_bytes} B; it must hold 1..{SLOTS_MAX}")
            ttl_s = float(args.get("ttl_s") or 0.0)
            cid = self.store.create(root, page_bytes, slots, ttl_s)
            idx = CacheIndex(cid, root, page_bytes, slots, ttl_s)
            self.by_root[root], self.by_id[cid] = idx, idx
        elif page_bytes and page_bytes != idx.page_bytes or capacity and capacity // idx.page_bytes != idx.slots:
            raise status_error(StatusCode.INVALID_ARGUMENT,
                               f"kvcache {root} exists with page_bytes={idx.page_bytes} capacity_bytes="
                               f"{idx.slots * idx.page_bytes}; open it with those (or 0 to take them), or "
                               f"drop it (`threefs kvcache clear --drop {root}`)")
        self.caps[idx.cache_id] = (read_cap, write_cap)
        return {"cache": idx.cache_id, "page_bytes": idx.page_bytes, "slots": idx.slots, "access": access,
                "ttl_s": idx.ttl_s, "lease_s": self.lease_s}

    # -- operations ------------------------------------------------------------------------------
    def op_lookup(self, args: dict):
        idx = self._cache(args, write=False)
        found = idx.lookup(list(args["keys"]), self.clock(), bool(args.get("touch", True)),
                           bool(args.get("prefix", False)), args.get("count", "get"))
        return [None if e is None else (e.slot, e.length, e.crc, e.gen) for e in found]

    def op_reserve(self, args: dict):
        idx = self._cache(args, write=True)
        out = idx.reserve(list(args["keys"]), list(args["lengths"]), self.clock(), self.lease_s)
        self.store.persist(idx)
        return out

    def op_commit(self, args: dict):
        idx = self._cache(args, write=True)
        idx.abort([tuple(a) for a in args.get("aborts", ())])
        out = idx.commit([tuple(i) for i in args.get("items", ())], self.clock())
        self.store.persist(idx)
        return out

    def op_remove(self, args: dict):
        idx = self._cache(args, write=True)
        n = idx.remove(list(args["keys"]))
        self.store.persist(idx)
        return n

    def op_invalidate(self, args: dict):
        idx = self._cache(args, write=False)  # a reader that saw a torn page may drop that generation
        n = idx.invalidate([tuple(i) for i in args["items"]])
        self.store.persist(idx)
        return n

    def op_clear(self, args: dict):
        idx = self._cache(args, write=True)
        if args.get("drop"):
            n = len(idx.entries)
            self.store.drop(idx.cache_id)
            del self.by_root[idx.root], self.by_id[idx.cache_id]
            self.caps.pop(idx.cache_id, None)
            return n
        n = idx.clear()
        self.store.persist(idx)
        return n

    def op_stats(self, args: dict):
        if args.get("cache") is not None:
            return self._cache(args, write=False).stats()
        return [idx.stats() for idx in self.by_id.values()]  # counts only, no keys: anyone may see them

    def op_ping(self, args: dict):
        return {"caches": len(self.by_id), "pid": os.getpid()}

    # -- background ------------------------------------------------------------------------------
    def tick(self) -> None:
        """Expire reservations and TTL entries, write back access times and counters."""
        now = self.clock()
        for idx in list(self.by_id.values()):
            idx.sweep(now)
            self.store.persist(idx, with_atimes=True)

    async def dispatch(self, op: str, args: dict):
        if op == "open":
            return await self.op_open(args)
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            raise status_error(StatusCode.UNKNOWN_METHOD, f"kvcache service has no operation {op!r}")
        idx = self.by_id.get(args.get("cache"))
        if idx is not None and idx.cache_id not in self.caps and self.read_caps is not None:
            self.caps[idx.cache_id] = await self.read_caps(idx.root)  # after a restart: read them again
        return fn(args)


async def _serve_connection(svc: KVCacheService, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    try:
        while True:
            try:
                header = await reader.readexactly(protocol.HEADER_BYTES)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            try:
                body = await reader.readexactly(protocol.frame_length(header))
                rid, op, args = protocol.decode(body)
            except (ThreeFSError, ValueError, TypeError) as exc:
                writer.write(protocol.encode([0, int(StatusCode.PROTOCOL_ERROR), str(exc)]))
                return
            try:
                result = await svc.dispatch(op, args if isinstance(args, dict) else {})
                frame = protocol.encode([rid, 0, result])
            except ThreeFSError as exc:
                frame = protocol.encode([rid, int(exc.code), exc.message])
            except (KeyError, TypeError, ValueError) as exc:
                frame = protocol.encode([rid, int(StatusCode.INVALID_ARGUMENT), f"bad {op} request: {exc!r}"])
            except Exception as exc:  # a bug or a sick disk: answer, log, keep serving the others
                log.exception("kvcache %s failed", op)
                frame = protocol.encode([rid, int(StatusCode.INTERNAL), f"kvcache {op} failed: {exc!r}"])
            writer.write(frame)
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    except asyncio.CancelledError:  # the service is stopping: end the connection quietly
        pass
    finally:
        writer.close()


def _cap_reader(fs):
    from threefs.kvcache.client import CAP_READ, CAP_WRITE

    async def read_caps(root: str) -> tuple[str, str]:
        def read() -> tuple[str, str]:
            try:
                return (fs.read_bytes(f"{root}/{CAP_READ}").decode().strip(),
                        fs.read_bytes(f"{root}/{CAP_WRITE}").decode().strip())
            except FileNotFoundError:
                raise status_error(StatusCode.NOT_FOUND, f"{root} is not a kvcache root (no {CAP_READ}/"
                                   f"{CAP_WRITE}); KVCache(fs, root) creates them") from None
        return await asyncio.to_thread(read)

    return read_caps


def _connect_fs(config):
    from threefs.client.client import Client
    from threefs.common.config import ClientConfig, read_token

    return Client(ClientConfig(mgmtd=config.mgmtd, token=read_token(config.token_file)))


def _registration_ok(fs, addr: str) -> bool:
    """Does SERVICE_FILE still name this service? If not, log what it holds (a cause still to find: it
    was seen empty once, in a full test run) and say so; the caller publishes again."""
    try:
        raw = fs.read_bytes(SERVICE_FILE)
    except FileNotFoundError:
        raw = None
    try:
        info = json.loads(raw) if raw is not None else {}
        if info.get("pid") == os.getpid() and info.get("addr") == addr:
            return True
    except (ValueError, AttributeError):
        pass
    try:
        attr = fs.stat(SERVICE_FILE)
        what = f"inode {attr.inode}, length {attr.length}"
    except FileNotFoundError:
        what = "missing"
    log.warning("%s does not name this service (%s, read %r): publishing it again", SERVICE_FILE, what,
                None if raw is None else raw[:80])
    return False


def _publish(fs, addr: str) -> None:
    fs.mkdir(SERVICE_DIR, 0o755, parents=True, exist_ok=True)
    tmp = f"{SERVICE_FILE}.{os.getpid()}.tmp"
    fs.write_bytes(tmp, json.dumps({"addr": addr, "pid": os.getpid(), "started": time.time()}).encode())
    fs.chmod(tmp, 0o644)
    fs.rename(tmp, SERVICE_FILE)


async def serve(config) -> None:
    """Run the service of `config` (a ServiceConfig of type "kvcache") until SIGTERM/SIGINT."""
    import signal

    db_path = config.kv or "kvcache/index.db"
    store = IndexStore(db_path)
    fs = None
    while fs is None:  # mgmtd may still be starting
        try:
            fs = await asyncio.to_thread(_connect_fs, config)
        except ThreeFSError as exc:
            log.info("connect to the cluster: %s; retrying", exc)
            await asyncio.sleep(0.5)
    svc = KVCacheService(store, _cap_reader(fs))
    server = await asyncio.start_server(lambda r, w: _serve_connection(svc, r, w), config.listen_host,
                                        config.port, limit=protocol.FRAME_BYTES_MAX)
    servers = [server]
    if config.local_socket:  # same-host clients connect through a Unix socket (threefs/common/local_socket.py)
        port = server.sockets[0].getsockname()[1]
        try:
            socks = local_socket.listen_all(config.listen_host, port, config.advertise_host)
        except OSError as exc:
            server.close()
            raise SystemExit(f"{config.name}: cannot listen on {config.listen_host}:{port}: "
                             f"{exc.strerror or exc}") from None
        for _, sock in socks:
            servers.append(await asyncio.start_unix_server(lambda r, w: _serve_connection(svc, r, w), sock=sock,
                                                           limit=protocol.FRAME_BYTES_MAX))
    while True:  # meta may not serve yet
        try:
            await asyncio.to_thread(_publish, fs, config.addr)
            break
        except ThreeFSError as exc:
            log.info("publish %s: %s; retrying", SERVICE_FILE, exc)
            await asyncio.sleep(0.5)
    log.info("%s serving %d caches on %s", config.name, len(svc.by_id), config.addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    next_check = loop.time() + REGISTRATION_CHECK_S
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), FLUSH_INTERVAL_S)
        except asyncio.TimeoutError:
            pass
        try:
            svc.tick()
        except sqlite3.Error as exc:  # a full disk: keep serving, try again next tick
            log.warning("kvcache flush: %s", exc)
        if loop.time() >= next_check:  # the registration is ours to keep
            next_check = loop.time() + REGISTRATION_CHECK_S
            try:
                if not await asyncio.to_thread(_registration_ok, fs, config.addr):
                    await asyncio.to_thread(_publish, fs, config.addr)
            except ThreeFSError as exc:
                log.info("checking %s: %s", SERVICE_FILE, exc)
    for s in servers:
        s.close()
    svc.tick()
    store.close()
    await asyncio.to_thread(fs.close, 5)
