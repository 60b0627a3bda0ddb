"""Small batch reads from the caller's thread (client/storage_sync.py): same bytes as the event loop's path
(chunk boundaries, holes, the end of the file), many threads at once, and IOs of a dead storage service
handed to the loop's path, which reads them from another replica."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np

from threefs.client.client import Client

KiB = 1 << 10


def _sparse_file(fs, d, rng, chunk_size=64 * KiB, head=200 * KiB, hole=300 * KiB, tail=50 * KiB):
    """Chunks of chunk_size (64 KiB) over 3 chains; head (200 KiB) of data, a hole (300 KiB), tail (50 KiB)."""
    fs.mkdir(f"{d}/dir", chunk_size=chunk_size, stripe=3)
    path = f"{d}/dir/f"
    head, tail = rng.randbytes(head), rng.randbytes(tail)
    with fs.open(path, "wb") as f:
        f.write(head)
        f.seek(len(head) + hole)
        f.write(tail)
    return path, head + bytes(hole) + tail


def _check_batches(fs, attr, data, rng, batches: int, n: int = 64) -> None:
    for _ in range(batches):
        items, want = [], []
        for _ in range(n):
            length = rng.choice([0, 1, 100, 4096, 5000, 64 * KiB - 1, 100 * KiB])
            off = rng.randrange(0, len(data) + 4 * KiB)  # a few start at or past the end
            buf = np.full(length, 0xAB, dtype=np.uint8)
            items.append((attr, off, buf))
            want.append(data[off:off + length])
        for (_, off, buf), w, got in zip(items, want, fs.batch_read(items)):
            assert got == len(w), (off, len(buf))
            assert buf[:got].tobytes() == w, (off, len(buf))
            assert (buf[got:] == 0xAB).all()  # past the end: untouched


def test_small_batches_read_from_the_callers_thread(fs, d, rng):
    path, data = _sparse_file(fs, d, rng)
    attr = fs.stat(path)
    sync = fs._storage_sync
    before, handed = sync.batches, sync.handed_over
    _check_batches(fs, attr, data, rng, batches=20)
    assert sync.batches - before == 20  # every batch took this path ...
    assert sync.handed_over == handed  # ... and needed nothing of the loop's
    # a batch with a big IO (one 300 KiB piece of a 1 MiB chunk) is read here too, as a request of its own
    # received straight into the caller's buffer ...
    fs.mkdir(f"{d}/big", chunk_size=1024 * KiB)
    big = rng.randbytes(12 << 20)
    fs.write_bytes(f"{d}/big/f", big)
    buf = bytearray(300 * KiB)
    assert fs.batch_read([(f"{d}/big/f", 50, buf), (attr, 10, bytearray(10))]) == [300 * KiB, 10]
    assert bytes(buf) == big[50:50 + 300 * KiB]
    assert sync.batches - before == 21
    # ... but not one from a chunk's start (it may be the whole chunk: the loop's path may send it
    # zero-copy), nor big IOs of more than SYNC_SOLO_BYTES_MAX in all (they stream on the loop)
    assert fs.batch_read([(f"{d}/big/f", 1 << 20, buf)]) == [300 * KiB]
    assert bytes(buf) == big[1 << 20:(1 << 20) + 300 * KiB]
    bufs = [bytearray(900 * KiB) for _ in range(10)]
    assert fs.batch_read([(f"{d}/big/f", (k << 20) + 7, b) for k, b in enumerate(bufs)]) == [900 * KiB] * 10
    assert all(bytes(b) == big[(k << 20) + 7:(k << 20) + 7 + 900 * KiB] for k, b in enumerate(bufs))
    assert sync.batches - before == 21
    assert sync.handed_over == handed


def test_threads_read_at_once(fs, d, rng):
    path, data = _sparse_file(fs, d, rng)
    attr = fs.stat(path)
    seeds = [rng.randrange(1 << 30) for _ in range(6)]
    errors = []

    def reader(seed):
        import random

        try:
            _check_batches(fs, attr, data, random.Random(seed), batches=15)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]


def test_dead_service_ios_fail_over_on_the_loop_path(private_cluster, rng):
    cluster = private_cluster(3, 3)
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/d")
        path, data = _sparse_file(fs, "/d", rng)
        attr = fs.stat(path)
        sync = fs._storage_sync
        sync.sticky = False  # batches take turns over the services, so some go to the dead one
        _check_batches(fs, attr, data, rng, batches=3)  # connections to every service are pooled now
        handed = sync.handed_over
        mgmtds = [pid for name, pid in cluster.running().items() if name.startswith("mgmtd")]
        # mgmtd frozen: the client's routing keeps listing the dead service's targets as SERVING, so
        # this path keeps choosing them and must hand their IOs over
        for pid in mgmtds:
            os.kill(pid, signal.SIGSTOP)
        taken, items = _taken(sync), _items_taken(fs.aio.storage)
        try:
            cluster.kill("storage-2")
            _check_batches(fs, attr, data, rng, batches=6)
            # single small reads (read_one), taking turns over the services too (a turn comes round every 3
            # reads; mgmtd stays frozen only seconds)
            def read_some(read) -> None:
                for _ in range(6):
                    off = rng.randrange(len(data) - 4096)
                    buf = bytearray(4096)
                    assert read(off, buf) == 4096
                    assert bytes(buf) == data[off:off + 4096]

            read_some(lambda off, buf: fs.batch_read([(attr, off, buf)])[0])
            # the loop's path (_read_one_item) stays on one service while it is free: started at the dead one,
            # the first read fails there (then read the general way) and the next ones start at the next service
            storage = fs.aio.storage
            routing = fs.run(fs.aio.mgmtd.get())
            [dead] = [n.addr for n in routing.info.nodes.values() if n.node_id == 102]  # (storage-i: 100 + i)
            storage._turn = storage._services(routing)[1][dead]
            read_some(lambda off, buf: fs.run(fs.aio.read_into(attr, off, buf)))
            # and a thread's sticky single reads (read_one) the same way
            sync.sticky = True
            sync._turns.turn = storage._services(routing)[1][dead]
            before = len(taken)
            read_some(lambda off, buf: fs.batch_read([(attr, off, buf)])[0])
            assert taken[before] is None and None not in taken[before + 1:], taken[before:]
            sync.sticky = False
            # a few small chunk reads at once (_read_few_items), of one chain (chunks 0, 3 and 6), the same way
            few = _few_left(storage)
            storage._turn = storage._services(routing)[1][dead]
            for _ in range(6):
                _check_few(fs, attr, data, rng, [(rng.choice([0, 3, 6]) * 64 * KiB + rng.randrange(60) * KiB, 4096)
                                                 for _ in range(4)])
        finally:
            for pid in mgmtds:
                os.kill(pid, signal.SIGCONT)
        # the first went to the dead service and was read by the batch path, that service's target tried last;
        # the rest by the scalar path, from the next service
        assert any(v is not None for v in few[0].values()) and few[1:] == [{}] * 5, few
        # a 64-IO batch goes to one service, the next batch to the next: some went to the dead one
        assert sync.handed_over > handed
        # and some single reads went to the dead service (then read the general way), some not
        assert None in taken and any(taken)
        assert items == [False] + [True] * 5, items


def _chunk_items(fs, attr, ranges: list) -> list:
    """StorageClient ReadItems of (file offset, length) ranges that each lie in one chunk (as the FUSE
    daemon's reads reach StorageClient.read), each with a destination of 0xAB bytes."""
    from threefs.cluster.storage_client import ReadItem
    from threefs.common.ids import chunk_id

    routing = fs.run(fs.aio.mgmtd.get())
    chains = fs.aio._chains_of(routing, attr.layout)
    cs = attr.layout.chunk_size
    items = []
    for off, n in ranges:
        index, within = divmod(off, cs)
        items.append(ReadItem(int(chains[index % len(chains)]), chunk_id(attr.inode, index), within, n,
                              memoryview(bytearray(b"\xab" * n))))
    return items


def _few_left(storage) -> list:
    """Record what each StorageClient._read_few_items call left to the batch path ({item: failed target})."""
    out, original = [], storage._read_few_items

    async def read_few_items(items):
        left = await original(items)
        out.append(dict(left))
        return left

    storage._read_few_items = read_few_items
    return out


def _check_few(fs, attr, data, rng, ranges: list) -> None:
    items = _chunk_items(fs, attr, ranges)
    fs.run(fs.aio.storage.read(items))
    cs = attr.layout.chunk_size
    for it, (off, n) in zip(items, ranges):
        stored = data[off:min(off + n, len(data))]  # a chunk's bytes end where the file's do (the rest: zeros)
        assert it.error is None, it.error
        want = stored + bytes(n - len(stored))
        assert bytes(it.dest) == want, (off, n)
        assert it.result <= n and off % cs + n <= cs


def _every_chain_file(fs, d, rng):
    """16 chunks of 64 KiB over 4 chains; batches that touch every chunk (so every chain, and a plan numbers
    the services alike for each of them)."""
    fs.mkdir(f"{d}/every", chunk_size=64 * KiB, stripe=4)
    data = rng.randbytes(16 * 64 * KiB)
    fs.write_bytes(f"{d}/every/f", data)
    return fs.stat(f"{d}/every/f"), data


def _read_every_chunk(fs, attr, data, rng) -> None:
    items = [(attr, c * 64 * KiB + rng.randrange(60 * KiB), bytearray(1 * KiB)) for c in range(16) for _ in range(4)]
    assert fs.batch_read(items) == [1 * KiB] * len(items)
    for _, off, buf in items:
        assert bytes(buf) == data[off:off + KiB]


def _services_used(fs) -> set[str]:
    pool = fs._storage_sync._pool
    return {addr for addr, n in pool._count.items() if n}


def test_a_threads_batches_stay_on_one_service(cluster, fs, d, rng):
    attr, data = _every_chain_file(fs, d, rng)
    with Client.connect(str(cluster.client_config_path)) as c:  # a client of its own: no pooled connections
        for _ in range(9):  # rotating, 9 batches would visit all 3 services
            _read_every_chunk(c, attr, data, rng)
        assert len(_services_used(c)) == 1
        other = threading.Thread(target=lambda: [_read_every_chunk(c, attr, data, rng) for _ in range(3)])
        other.start()
        other.join(timeout=120)
        assert len(_services_used(c)) == 2  # the next thread takes the next turn
    with Client.connect(str(cluster.client_config_path)) as c:
        c._storage_sync.sticky = False  # the round robin per batch, for contrast
        for _ in range(9):
            _read_every_chunk(c, attr, data, rng)
        assert len(_services_used(c)) == 3


def test_a_threads_reads_of_a_few_chains_stay_on_one_service(cluster, fs, d, rng):
    """The turn names a service, whichever chains a read touches: a thread's single small reads (read_one)
    and its batches of a few random chunks (each chain lists its replicas in its own order, so a turn that
    picked a position in that list landed on another service with each chain) all go to one service."""
    attr, data = _every_chain_file(fs, d, rng)
    with Client.connect(str(cluster.client_config_path)) as c:  # a client of its own: no pooled connections
        taken = c._storage_sync.batches
        with c.open(f"{d}/every/f", "rb") as f:
            for _ in range(24):  # random jumps: each one read alone, from this thread
                off, buf = rng.randrange(len(data) - KiB), bytearray(KiB)
                f.seek(off)
                assert f.readinto(buf) == KiB and bytes(buf) == data[off:off + KiB]
        for _ in range(12):  # batches of 1-3 chunks (1-3 of the 4 chains)
            chunks = rng.sample(range(16), rng.randint(1, 3))
            items = [(attr, c_ * 64 * KiB + rng.randrange(60 * KiB), bytearray(KiB)) for c_ in chunks]
            assert c.batch_read(items) == [KiB] * len(items)
            for _, off, buf in items:
                assert bytes(buf) == data[off:off + KiB]
        assert c._storage_sync.batches > taken  # (the batches were read from this thread)
        assert len(_services_used(c)) == 1


def test_a_thread_moves_on_from_a_service_that_failed_its_batch(private_cluster, rng):
    cluster = private_cluster(3, 3)
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/d")
        attr, data = _every_chain_file(fs, "/d", rng)
        _read_every_chunk(fs, attr, data, rng)
        [addr] = _services_used(fs)
        routing = fs.run(fs.aio.mgmtd.get())
        [node] = [n.node_id for n in routing.info.nodes.values() if n.addr == addr]
        name = f"storage-{node - 100}"  # (LocalCluster numbers storage-i as node 100 + i)
        sync = fs._storage_sync
        handed = sync.handed_over
        mgmtds = [pid for n, pid in cluster.running().items() if n.startswith("mgmtd")]
        for pid in mgmtds:  # routing keeps listing the dead service's targets as SERVING
            os.kill(pid, signal.SIGSTOP)
        try:
            cluster.kill(name)
            for _ in range(5):
                _read_every_chunk(fs, attr, data, rng)
        finally:
            for pid in mgmtds:
                os.kill(pid, signal.SIGCONT)
        # the first batch found the service dead and was read elsewhere; the thread went on to the next
        # service, whose batches needed no help
        assert sync.handed_over == handed + 1


def _child_services(fs, attr, data, seed, q):
    import random

    try:
        for _ in range(4):
            _read_every_chunk(fs, attr, data, random.Random(seed))
        q.put(sorted(_services_used(fs)))
    except BaseException as e:  # report, never hang the parent
        q.put(repr(e))


def test_forked_workers_stay_on_different_services(fs, d, rng):
    """Workers forked one after another (a DataLoader's) start their turn on consecutive services, whatever
    their process ids (threads started between the forks take ids too, as a started worker's own threads
    do): two of them read from two different services, each from one."""
    import multiprocessing as mp

    attr, data = _every_chain_file(fs, d, rng)
    ctx = mp.get_context("fork")
    for trial in range(3):
        q = ctx.Queue()
        procs = [ctx.Process(target=_child_services, args=(fs, attr, data, trial * 2 + k, q)) for k in range(2)]
        procs[0].start()
        for _ in range(trial + 2):  # ids taken between the two forks: the pids differ by 3, 4 and 5
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()
        procs[1].start()
        got = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert all(isinstance(g, list) and len(g) == 1 for g in got), got
        assert got[0] != got[1], got


def test_big_samples_are_received_into_their_own_buffers(cluster, d, rng):
    """Random samples of 64 KiB (and 40 KiB + 1) read into slices of one arena in another order than their
    payload slots: received by the caller's thread straight into each sample's slice (a Scatter; the
    connection's scratch buffer is never used), holes included, the same bytes."""
    with Client.connect(str(cluster.client_config_path)) as fs:  # fresh connections: an unused scratch
        path, data = _sparse_file(fs, d, rng, 256 * KiB, 1024 * KiB, 1024 * KiB, 1024 * KiB)
        attr = fs.stat(path)
        sync = fs._storage_sync
        for size in (64 * KiB, 40 * KiB + 1):
            for _ in range(4):
                n = 48
                arena = np.full(n * size, 0xAB, dtype=np.uint8)
                slots = rng.sample(range(n), n)  # sample i lands in slot slots[i] of the arena
                offs = [rng.randrange(0, len(data) // (64 * KiB)) * 64 * KiB for _ in range(n)]
                items = [(attr, o, arena[s * size:(s + 1) * size]) for o, s in zip(offs, slots)]
                assert fs.batch_read(items) == [size] * n
                for o, s in zip(offs, slots):
                    assert arena[s * size:(s + 1) * size].tobytes() == data[o:o + size], (size, o)
        assert sync.batches >= 8 and sync.handed_over == 0
        scratch = [len(conn._scratch) for conns in sync._pool._idle.values() for conn in conns]
        assert scratch and sum(scratch) == 0  # every payload went straight into the samples' buffers


def _taken(sync) -> list:
    """Record what each SyncStorageReads.read_one call returned (None: not taken)."""
    out, original = [], sync.read_one

    def read_one(*args):
        out.append(original(*args))
        return out[-1]

    sync.read_one = read_one
    return out


def _items_taken(storage) -> list:
    """Record whether each StorageClient._read_one_item call read its item (False: read in a batch)."""
    out, original = [], storage._read_one_item

    async def read_one_item(it):
        done, failed = await original(it)
        out.append(done)
        return done, failed

    storage._read_one_item = read_one_item
    return out


def test_one_small_read_takes_the_scalar_path_and_reads_the_same_bytes(fs, d, rng):
    """A batch of one small read that lies in one chunk (and a file object's jump) is read by read_one, and
    an async read of one small chunk IO (a FUSE request on its own) by _read_one_item: the bytes, holes and
    the end of the file as the batch path reads them; a read across chunks, a big one and one past the end
    are not taken and read the general way."""
    path, data = _sparse_file(fs, d, rng)  # 64 KiB chunks; data, a hole, data
    attr = fs.stat(path)
    taken, items = _taken(fs._storage_sync), _items_taken(fs.aio.storage)
    cases = [(0, 100), (5, 4096), (64 * KiB - 10, 10), (250 * KiB, 4096),  # data; the hole
             (len(data) - 7, 100), (len(data) - 4096, 4096)]  # clamped at the end of the file
    cases += [(rng.randrange(len(data)), rng.choice([1, 512, 4096, 9000])) for _ in range(200)]
    for off, length in cases:
        want = data[off:off + length]
        one_chunk = off // (64 * KiB) == (off + len(want) - 1) // (64 * KiB)
        buf = bytearray(b"\xab" * length)
        assert fs.batch_read([(attr, off, buf)]) == [len(want)]
        assert bytes(buf[:len(want)]) == want and buf[len(want):] == b"\xab" * (length - len(want))
        assert taken[-1] == len(want) or not one_chunk, (off, length)
        buf = bytearray(b"\xab" * length)  # the async API: the loop's path
        assert fs.run(fs.aio.read_into(attr, off, buf)) == len(want)
        assert bytes(buf[:len(want)]) == want and buf[len(want):] == b"\xab" * (length - len(want))
        assert items[-1] is True or not one_chunk, (off, length)
    del taken[:]
    for off, length in [(64 * KiB - 10, 20), (0, 200 * KiB)]:  # across a chunk boundary; >= SOLO_IO_BYTES_MIN
        buf = bytearray(length)
        assert fs.batch_read([(attr, off, buf)]) == [length] and bytes(buf) == data[off:off + length]
    assert fs.batch_read([(attr, len(data) + 5, bytearray(10))]) == [0]  # past the end: nothing to read
    assert taken == [None, None, None]
    with fs.open(path, "rb") as f:  # a file object's jumps
        for off in (300_000, 12_345, 100):
            f.seek(off)
            assert f.read(1000) == data[off:off + 1000]
        assert taken[-3:] == [1000, 1000, 1000]


def test_a_few_small_chunk_reads_take_the_scalar_path(fs, d, rng):
    """2 to FEW_ITEMS_MAX small chunk reads at once (FUSE requests the gate sent together) are planned,
    packed and checked in scalar Python (StorageClient._read_few_items), one request per service: the
    bytes, holes and a chunk's end as the batch path reads them; a retried item goes to the batch path,
    and so does a batch of more than FEW_ITEMS_MAX."""
    from threefs.cluster.storage_client import FEW_ITEMS_MAX

    path, data = _sparse_file(fs, d, rng)  # 64 KiB chunks; data, a hole, data (the last chunk short)
    attr = fs.stat(path)
    left = _few_left(fs.aio.storage)
    cs = 64 * KiB
    for _ in range(40):
        ranges = []
        for _ in range(rng.randrange(2, FEW_ITEMS_MAX + 1)):
            n = rng.choice([1, 100, 4096, 5000, 60 * KiB])
            chunk = rng.randrange((len(data) + cs - 1) // cs)
            ranges.append((chunk * cs + rng.randrange(cs - n + 1), n))
        _check_few(fs, attr, data, rng, ranges)
        assert left[-1] == {}, ranges
    items = _chunk_items(fs, attr, [(0, 4096), (cs, 4096), (3 * cs + 5, 700)])
    items[1].avoid = {items[1].target}  # a retry: the batch path, which tries those replicas last
    fs.run(fs.aio.storage.read(items))
    assert left[-1] == {1: None}
    assert [bytes(it.dest) for it in items] == [data[0:4096], data[cs:cs + 4096], data[3 * cs + 5:3 * cs + 705]]
    calls = len(left)
    _check_few(fs, attr, data, rng, [(k * 997, 512) for k in range(FEW_ITEMS_MAX + 1)])
    assert len(left) == calls, "more than FEW_ITEMS_MAX: the batch path"
