"""Updates of one chunk run one at a time inside chunk engine v2, whatever its callers do.

The 30-minute soak found committed v2 chunks failing their checksum after storage restarts: a request
whose task was cancelled (deadline, closed connection) released its chunk lock while its engine call
still ran in a disk thread, and the next update of that chunk (a retry, a resync) ran beside it. An update
builds its new state on the state it read first, so the late one put back the committed block the other
had freed; the allocator gave that block to another chunk, whose bytes then overwrote it. Here the first
update is held inside its data write (a real engine, a real file) while a second update of the same chunk
runs on another thread: it must wait, and the target must end consistent."""

from __future__ import annotations

import threading

from threefs.storage.chunk_engine_v2 import ChunkEngineV2
from threefs.storage.target_check import check_target
from threefs.testing.checks import wait_for

CHUNK = 64 * 1024


def cid(i: int) -> bytes:
    return bytes(8) + i.to_bytes(8, "big")


def test_a_second_update_of_a_chunk_waits_for_the_first(tmp_path):
    eng = ChunkEngineV2(str(tmp_path / "t"))
    x, y = cid(1), cid(2)
    eng.write(x, update_ver=1, chain_ver=1, offset=0, data=b"a" * CHUNK, chunk_size=CHUNK)
    eng.commit(x, 1)
    inside, release = threading.Event(), threading.Event()
    real_pwrite = eng._pwrite

    def held_pwrite(pos, offset, buffers):  # the late update, held in its data write
        if threading.current_thread().name == "late" and not inside.is_set():
            inside.set()
            assert release.wait(30)
        return real_pwrite(pos, offset, buffers)

    eng._pwrite = held_pwrite
    late = threading.Thread(name="late", target=lambda: eng.write(
        x, update_ver=2, chain_ver=1, offset=0, data=b"b" * CHUNK, chunk_size=CHUNK, full_replace=True))
    late.start()
    assert inside.wait(30)
    order = []

    def resync():  # what the retry / resync does: remove, then the whole chunk again
        eng.remove(x, update_ver=3, chain_ver=1)
        order.append("removed")
        eng.commit(x, 3)
        eng.write(x, update_ver=1, chain_ver=1, offset=0, data=b"c" * CHUNK, chunk_size=CHUNK, full_replace=True)
        eng.commit(x, 1)

    other = threading.Thread(target=resync)
    other.start()
    wait_for(lambda: eng._waiters == 1, "the second update to wait")
    assert order == []  # it waits while the first runs
    release.set()
    late.join(30)
    other.join(30)
    assert not late.is_alive() and not other.is_alive()
    assert order == ["removed"]
    # another chunk of the same size class takes whatever block was freed
    eng.write(y, update_ver=1, chain_ver=1, offset=0, data=b"y" * CHUNK, chunk_size=CHUNK)
    eng.commit(y, 1)
    meta = eng.get_meta(x)
    assert (meta.commit_ver, meta.update_ver) == (1, 1)  # the late pending version was removed after it
    assert eng.read(x, 0, CHUNK)[0] == b"c" * CHUNK
    assert eng.verify(x) and eng.verify(y)
    eng.close()
    report = check_target(str(tmp_path / "t"))
    assert report.ok, "\n".join(report.lines())


def test_many_threads_updating_few_chunks_leave_a_consistent_target(tmp_path):
    """Seeded random updates of 3 chunks from 4 threads with no lock of their own: every committed
    chunk reads back its checksum, no block is owned twice or leaked."""
    import random

    eng = ChunkEngineV2(str(tmp_path / "t"))
    versions: dict[int, int] = {}
    vlock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                c = rng.randrange(3)
                with vlock:
                    v = versions[c] = versions.get(c, 0) + 1
                roll = rng.random()
                try:
                    if roll < 0.6:
                        off = rng.choice([0, rng.randrange(CHUNK)])
                        n = rng.randrange(1, CHUNK - off + 1)
                        eng.write(cid(c), update_ver=v, chain_ver=1, offset=off, data=rng.randbytes(n),
                                  chunk_size=CHUNK, full_replace=off == 0 and rng.random() < 0.3)
                    elif roll < 0.75:
                        eng.truncate(cid(c), update_ver=v, chain_ver=1, length=rng.randrange(CHUNK),
                                     chunk_size=CHUNK)
                    else:
                        eng.remove(cid(c), update_ver=v, chain_ver=1)
                    eng.commit(cid(c), v)
                except Exception as exc:  # version races between threads answer STALE/MISSING_UPDATE
                    if getattr(exc, "code", None) is None:
                        raise
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for c in range(3):
        meta = eng.get_meta(cid(c))
        if meta is not None and meta.commit_ver:
            assert eng.verify(cid(c)), f"chunk {c} fails its checksum"
    eng.close()
    report = check_target(str(tmp_path / "t"))
    assert report.ok, "\n".join(report.lines())
