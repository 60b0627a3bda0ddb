"""One chunk-store suite, run against the real ChunkEngine (v1), ChunkEngineV2 and the simulator's SimStore.

The CRAQ simulator is only evidence about the storage service if its store answers the flows as the
engine does. Every test here runs on both stores (`store` fixture), and a seeded differential test runs
one random operation sequence on both in lockstep and compares every answer, errors included.

Semantics both implement (what CRAQ needs):
- one committed and at most one pending version per chunk; a write or truncate builds its pending
  version on the COMMITTED bytes (a newer pending version replaces an older one);
- reads see the committed version; `pending=True` sees the newest (CHUNK_NOT_FOUND for a pending removal);
- committing a version that is not pending is a no-op only when it is already committed; otherwise it is
  an error (STALE_UPDATE if a newer version is pending, MISSING_UPDATE if not): a silent success would
  let a replica acknowledge a write it does not hold;
- a crash keeps committed AND pending versions (the engine logs a pending version before the write
  returns): a restarted replica still holds a version that may be committed further down its chain.

Restart of the engine here is close + reopen: the engine buffers nothing in memory (each call's data and
log append are written before it returns; close() only closes descriptors), so this is `kill -9` with the
page cache intact. A real kill -9 at random instants is test_chunk_engine.py's crash test.
"""

from __future__ import annotations

import random

import crc32c
import pytest

from threefs.common.status import StatusCode, ThreeFSError
from threefs.storage import craq
from threefs.storage.chunk_engine import ChunkEngine
from threefs.storage.chunk_engine_v2 import ChunkEngineV2
from threefs.testing.sim_store import SimStore

CHUNK = 4096


def cid(i: int) -> bytes:
    return bytes(15) + bytes([i])


class EngineStore:
    name = "engine"

    def __init__(self, path: str):
        self.path = path
        self.s = ChunkEngine(path)

    def restart(self) -> None:
        self.s.close()
        self.s = ChunkEngine(self.path)

    def close(self) -> None:
        self.s.close()


class EngineV2Store(EngineStore):
    name = "engine2"

    def __init__(self, path: str):
        self.path = path
        self.s = ChunkEngineV2(path)

    def restart(self) -> None:
        self.s.close()
        self.s = ChunkEngineV2(self.path)


class SimStoreHarness:
    name = "sim"

    def __init__(self, path: str):
        self.s = SimStore()

    def restart(self) -> None:
        self.s.crash()

    def close(self) -> None:
        pass


@pytest.fixture(params=[EngineStore, EngineV2Store, SimStoreHarness], ids=["engine", "engine2", "sim"])
def store(request, tmp_path):
    harness = request.param(str(tmp_path / "target"))
    yield harness
    harness.close()


def view(meta) -> tuple | None:
    """The fields both stores report, with the same meaning."""
    if meta is None:
        return None
    return (meta.chunk_id, meta.chain_ver, meta.update_ver, meta.commit_ver, meta.length, meta.crc,
            meta.pending_length, meta.pending_crc, meta.pending_remove, meta.last_request)


def write(s, c, ver, data, offset=0, full=False, chain_ver=1, tag=b"", data_crc=None):
    return s.write(c, update_ver=ver, chain_ver=chain_ver, offset=offset, data=data, chunk_size=CHUNK,
                   full_replace=full, last_request=tag, data_crc=data_crc)


def committed(s, c) -> bytes:
    return bytes(s.read(c, 0, CHUNK)[0])


def newest(s, c) -> bytes:
    return bytes(s.read(c, 0, CHUNK, pending=True)[0])


def code_of(fn, *args, **kwargs) -> StatusCode:
    with pytest.raises(ThreeFSError) as err:
        fn(*args, **kwargs)
    return err.value.code


# -- writes, reads of committed vs newest ------------------------------------------------------------
def test_pending_write_is_seen_only_as_newest_until_committed(store):
    s = store.s
    meta = write(s, cid(1), 1, b"hello")
    assert (meta.commit_ver, meta.update_ver, meta.length, meta.pending_length) == (0, 1, 0, 5)
    assert meta.pending_crc == crc32c.crc32c(b"hello") and meta.crc == 0
    assert committed(s, cid(1)) == b"" and newest(s, cid(1)) == b"hello"  # never committed: empty
    meta = s.commit(cid(1), 1)
    assert (meta.commit_ver, meta.update_ver, meta.length, meta.crc) == (1, 1, 5, crc32c.crc32c(b"hello"))
    assert committed(s, cid(1)) == newest(s, cid(1)) == b"hello"
    assert bytes(s.read(cid(1), 1, 3)[0]) == b"ell" and bytes(s.read(cid(1), 4, 100)[0]) == b"o"
    assert bytes(s.read(cid(1), 9, 4)[0]) == b""


def test_a_write_builds_on_the_committed_version_and_replaces_the_pending_one(store):
    s = store.s
    write(s, cid(2), 1, b"aaaaaa")
    s.commit(cid(2), 1)
    write(s, cid(2), 2, b"XX", offset=2)
    assert newest(s, cid(2)) == b"aaXXaa" and committed(s, cid(2)) == b"aaaaaa"
    write(s, cid(2), 2, b"YYYY", offset=4)  # replaces the pending version, built on the committed one
    assert newest(s, cid(2)) == b"aaaaYYYY"
    write(s, cid(2), 2, b"Z", offset=10)  # past the end: zero-filled
    assert newest(s, cid(2)) == b"aaaaaa\0\0\0\0Z"
    write(s, cid(2), 2, b"ab", full=True)  # a full replace may shrink
    assert newest(s, cid(2)) == b"ab"
    assert s.commit(cid(2), 2).length == 2 and committed(s, cid(2)) == b"ab"


def test_truncate_shorter_and_longer(store):
    s = store.s
    write(s, cid(3), 1, b"abcdef")
    s.commit(cid(3), 1)
    s.truncate(cid(3), update_ver=2, chain_ver=1, length=3, chunk_size=CHUNK)
    assert newest(s, cid(3)) == b"abc" and committed(s, cid(3)) == b"abcdef"
    s.truncate(cid(3), update_ver=2, chain_ver=1, length=8, chunk_size=CHUNK)
    assert newest(s, cid(3)) == b"abcdef\0\0"
    s.commit(cid(3), 2)
    assert committed(s, cid(3)) == b"abcdef\0\0"
    s.truncate(cid(4), update_ver=1, chain_ver=1, length=5, chunk_size=CHUNK)  # a new chunk
    s.commit(cid(4), 1)
    assert committed(s, cid(4)) == bytes(5)


def test_remove_is_a_pending_version_until_committed(store):
    s = store.s
    assert s.remove(cid(5), update_ver=1, chain_ver=1) is None  # nothing to remove
    write(s, cid(5), 1, b"data")
    s.commit(cid(5), 1)
    meta = s.remove(cid(5), update_ver=2, chain_ver=1)
    assert meta.pending_remove and (meta.update_ver, meta.commit_ver, meta.pending_length) == (2, 1, 0)
    assert committed(s, cid(5)) == b"data"  # readers still see the committed version
    assert code_of(s.read, cid(5), 0, CHUNK, pending=True) == StatusCode.CHUNK_NOT_FOUND
    assert craq.apply_to_store(s, craq.ReadNewest(cid(5), CHUNK)) == b""  # the flows' view: empty
    assert s.commit(cid(5), 2) is None and s.get_meta(cid(5)) is None
    assert s.commit(cid(5), 2) is None  # a repeated commit of a removal
    assert code_of(s.read, cid(5), 0, CHUNK) == StatusCode.CHUNK_NOT_FOUND
    write(s, cid(6), 1, b"never committed")  # a chunk with only a pending version can be removed
    assert s.remove(cid(6), update_ver=2, chain_ver=1).pending_remove
    assert s.commit(cid(6), 2) is None and s.get_meta(cid(6)) is None
    assert s.iter_metas() == []


def test_abort_drops_the_pending_version_only(store):
    s = store.s
    write(s, cid(7), 1, b"v1")
    s.commit(cid(7), 1)
    write(s, cid(7), 2, b"v2")
    s.abort(cid(7))
    assert view(s.get_meta(cid(7)))[2:4] == (1, 1) and newest(s, cid(7)) == b"v1"
    write(s, cid(8), 1, b"x")
    s.abort(cid(8))
    assert s.get_meta(cid(8)) is None


# -- commits and versions --------------------------------------------------------------------------
def test_commit_of_a_version_that_is_not_pending(store):
    s = store.s
    write(s, cid(9), 1, b"v1")
    s.commit(cid(9), 1)
    write(s, cid(9), 2, b"v2")
    s.commit(cid(9), 2)
    assert s.commit(cid(9), 2).commit_ver == 2  # already committed: a no-op
    assert s.commit(cid(9), 1).commit_ver == 2
    assert code_of(s.commit, cid(9), 3) == StatusCode.MISSING_UPDATE  # nothing pending
    write(s, cid(9), 5, b"v5")
    assert code_of(s.commit, cid(9), 4) == StatusCode.STALE_UPDATE  # a newer one is pending
    assert code_of(s.commit, cid(9), 6) == StatusCode.MISSING_UPDATE  # an older one is pending
    assert newest(s, cid(9)) == b"v5" and committed(s, cid(9)) == b"v2"  # errors change nothing
    assert s.commit(cid(9), 5, chain_ver=9).chain_ver == 9


def test_commit_of_another_version_of_a_never_committed_chunk_is_an_error(store):
    """The case where the simulator's store used to answer with a silent no-op (commit_ver 0)."""
    s = store.s
    write(s, cid(10), 2, b"pending v2")
    assert code_of(s.commit, cid(10), 1) == StatusCode.STALE_UPDATE
    assert code_of(s.commit, cid(10), 3) == StatusCode.MISSING_UPDATE
    assert view(s.get_meta(cid(10)))[2:4] == (2, 0)


def test_chain_version_and_request_tag_are_stamped(store):
    s = store.s
    write(s, cid(11), 1, b"a", chain_ver=3, tag=b"client:1")
    assert s.get_meta(cid(11)).last_request == b"client:1"
    assert s.commit(cid(11), 1).chain_ver == 3  # default: the write's chain version
    write(s, cid(11), 2, b"b", chain_ver=4, tag=b"client:2")
    meta = s.get_meta(cid(11))
    assert meta.chain_ver == 3 and meta.last_request == b"client:2"  # committed's chain, pending's tag
    assert s.commit(cid(11), 2, chain_ver=7).chain_ver == 7


def test_invalid_arguments_are_refused_alike(store):
    s = store.s
    bad = StatusCode.INVALID_ARGUMENT
    assert code_of(s.get_meta, b"short") == bad
    assert code_of(write, s, cid(12), 0, b"x") == bad  # versions start at 1
    assert code_of(write, s, cid(12), 1, b"x", chain_ver=-1) == bad
    assert code_of(write, s, cid(12), 1, b"x" * (CHUNK + 1)) == bad  # beyond the chunk size
    assert code_of(write, s, cid(12), 1, b"x", offset=CHUNK) == bad
    assert code_of(write, s, cid(12), 1, b"x", offset=-1) == bad
    assert code_of(write, s, cid(12), 1, b"x", offset=1, full=True) == bad
    assert code_of(write, s, cid(12), 1, b"x", tag=b"t" * 257) == bad
    assert code_of(s.truncate, cid(12), update_ver=1, chain_ver=1, length=-1, chunk_size=CHUNK) == bad
    assert code_of(s.truncate, cid(12), update_ver=1, chain_ver=1, length=CHUNK + 1, chunk_size=CHUNK) == bad
    assert code_of(s.read, cid(12), -1, 4) == bad
    assert s.get_meta(cid(12)) is None  # refused calls leave nothing behind


def test_iter_metas_ordering_range_reverse_limit(store):
    s = store.s
    for i in (5, 1, 3, 9):
        write(s, cid(i), 1, bytes([i]))
    s.commit(cid(3), 1)
    ids = lambda metas: [m.chunk_id[-1] for m in metas]  # noqa: E731
    assert ids(s.iter_metas()) == [1, 3, 5, 9]  # never-committed chunks included
    assert ids(s.iter_metas(cid(3), cid(9))) == [3, 5]
    assert ids(s.iter_metas(reverse=True, limit=2)) == [9, 5]
    assert code_of(s.iter_metas, limit=-1) == StatusCode.INVALID_ARGUMENT


# -- crash and restart ------------------------------------------------------------------------------
def test_a_restart_keeps_committed_and_pending_versions(store):
    s = store.s
    write(s, cid(13), 1, b"committed")
    s.commit(cid(13), 1)
    write(s, cid(13), 2, b"pending", full=True, tag=b"c:2")
    write(s, cid(14), 1, b"only pending")
    write(s, cid(15), 1, b"to remove")
    s.commit(cid(15), 1)
    s.remove(cid(15), update_ver=2, chain_ver=1)
    before = [view(s.get_meta(cid(i))) for i in (13, 14, 15)]
    store.restart()
    s = store.s
    assert [view(s.get_meta(cid(i))) for i in (13, 14, 15)] == before
    assert committed(s, cid(13)) == b"committed" and newest(s, cid(13)) == b"pending"
    assert newest(s, cid(14)) == b"only pending"
    assert s.commit(cid(13), 2).commit_ver == 2 and committed(s, cid(13)) == b"pending"
    assert s.commit(cid(15), 2) is None and s.get_meta(cid(15)) is None
    store.restart()
    s = store.s
    assert committed(s, cid(13)) == b"pending" and s.get_meta(cid(15)) is None
    assert view(s.get_meta(cid(14)))[2:4] == (1, 0)


def test_a_committed_removal_of_a_never_committed_chunk_stays_removed(store):
    """Found by the differential test below: the engine logged nothing when it committed the removal
    of a chunk that had only a pending version, so the pending removal came back after a restart (the
    chunk then showed a pending version for good: CHUNK_NOT_COMMIT to readers)."""
    s = store.s
    write(s, cid(17), 1, b"only pending")
    s.remove(cid(17), update_ver=2, chain_ver=1)
    assert s.commit(cid(17), 2) is None
    store.restart()
    assert store.s.get_meta(cid(17)) is None and store.s.iter_metas() == []


# -- the CRAQ flows on either store ------------------------------------------------------------------
def run_flow(flow, s):
    """Drive a CRAQ flow synchronously on one store (a one-replica chain: no forwarding happens)."""
    value, error = None, None
    while True:
        try:
            effect = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            return stop.value
        value, error = None, None
        try:
            value = 0.0 if isinstance(effect, craq.Now) else craq.apply_to_store(s, effect)
        except ThreeFSError as e:
            error = e


def test_a_head_with_a_leftover_pending_removal_takes_the_next_write(store):
    """A removal whose forwarding failed stays pending at the head; the next write composes on the
    removal's result (an empty chunk) as a full replace. With the engine the flow read the newest
    version with read(pending=True), got CHUNK_NOT_FOUND, and every later write of the chunk failed."""
    from threefs.rpc.schemas import mgmtd as ms
    from threefs.rpc.schemas import storage as ss

    s, me = store.s, 10
    chain = ms.ChainInfo(1, 1, [ms.ChainTarget(me, ms.SERVING)])
    write(s, cid(16), 1, b"old contents")
    s.commit(cid(16), 1)
    s.remove(cid(16), update_ver=2, chain_ver=1)  # left pending
    req = ss.UpdateReq(1, 1, cid(16), ss.WRITE, 2, 3, CHUNK, crc32c.crc32c(b"new"))
    rsp = run_flow(craq.update_flow(me, chain, req, b"new"), s)
    assert rsp.commit_ver == 3 and committed(s, cid(16)) == b"\0\0new"


# -- both stores, one random history -----------------------------------------------------------------
@pytest.mark.parametrize("engine_cls", [EngineStore, EngineV2Store], ids=["engine", "engine2"])
@pytest.mark.parametrize("seed", range(4))
def test_both_stores_answer_a_random_history_alike(tmp_path, seed, engine_cls):
    """Seeded random writes / truncates / removes / commits (right, stale and missing versions) /
    aborts / restarts, applied to both stores in lockstep: every answer (metadata, bytes read, error
    code) must be the same."""
    rng = random.Random(seed)
    engine, sim = engine_cls(str(tmp_path / "target")), SimStoreHarness("")
    try:
        for step in range(500):
            c = cid(rng.randrange(4))
            meta = sim.s.get_meta(c)
            top = max(meta.update_ver, meta.commit_ver) if meta else 0
            ver = max(1, top + rng.choice([-1, 0, 1, 1, 1, 2]))
            action = rng.random()
            if action < 0.3:
                offset = rng.choice([0, rng.randrange(CHUNK)])
                data = rng.randbytes(rng.randrange(0, (CHUNK - offset) // rng.choice([1, 16]) + 1))
                full = offset == 0 and rng.random() < 0.3
                # half of them with the data's crc32c given, as the storage service gives it
                data_crc = crc32c.crc32c(data) if rng.random() < 0.5 else None
                call = ("write", lambda s: write(s, c, ver, data, offset=offset, full=full,
                                                 tag=f"t{step}".encode(), data_crc=data_crc))
            elif action < 0.4:
                length = rng.randrange(CHUNK + 1)
                call = ("truncate", lambda s: s.truncate(c, update_ver=ver, chain_ver=1, length=length,
                                                         chunk_size=CHUNK))
            elif action < 0.47:
                call = ("remove", lambda s: s.remove(c, update_ver=ver, chain_ver=1))
            elif action < 0.8:
                commit_ver = rng.choice([ver, top, top + 1, max(1, top - 1)])
                call = ("commit", lambda s: s.commit(c, commit_ver, chain_ver=rng_chain))
                rng_chain = rng.choice([None, 2])
            elif action < 0.86:
                call = ("abort", lambda s: s.abort(c))
            elif action < 0.9:
                engine.restart()
                sim.restart()
                call = ("meta", lambda s: s.get_meta(c))
            else:
                pending = rng.random() < 0.5
                offset, length = rng.randrange(CHUNK), rng.randrange(CHUNK + 1)
                call = ("read", lambda s: (bytes(s.read(c, offset, length, pending=pending)[0]),
                                           s.read(c, offset, length, pending=pending)[1]))
            answers = []
            for harness in (engine, sim):
                try:
                    out = call[1](harness.s)
                    out = (bytes(out[0]), view(out[1])) if isinstance(out, tuple) else view(out)
                    answers.append(("ok", out))
                except ThreeFSError as e:
                    answers.append(("error", e.code))
            assert answers[0] == answers[1], f"seed {seed} step {step} {call[0]}: {answers}"
            for i in range(4):
                assert view(engine.s.get_meta(cid(i))) == view(sim.s.get_meta(cid(i))), (seed, step)
        assert [view(m) for m in engine.s.iter_metas()] == [view(m) for m in sim.s.iter_metas()]
    finally:
        engine.close()


def test_verify_checks_the_committed_copy(store):
    """`verify` (the scrub's, and the CRAQ flows' before a delta lands on the committed bytes): True for
    a committed chunk and for a chunk with only a pending version, CHUNK_NOT_FOUND for an unknown one."""
    s = store.s
    assert code_of(s.verify, cid(40)) == StatusCode.CHUNK_NOT_FOUND
    write(s, cid(40), 1, b"abc")
    assert s.verify(cid(40))  # nothing committed yet
    s.commit(cid(40), 1)
    write(s, cid(40), 2, b"z", offset=1)
    assert s.verify(cid(40)) and craq.apply_to_store(s, craq.VerifyCommitted(cid(40)))
