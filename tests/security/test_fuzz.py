"""Fuzzing: the frame decoder (hypothesis, in-process) and every RPC schema of real mgmtd, meta and storage
processes over real connections. No crash (INTERNAL / traceback in a service log), no hang, bounded memory,
and well-formed clients are served throughout.

THREEFS_FUZZ_FRAMES sets how many malformed frames the stream test sends (soak: 1000000; CI default small);
THREEFS_FUZZ_BODIES sets the random bodies per RPC method.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sec_helpers import RawConn, request_frame, rss_bytes

from threefs.cli.cluster import LocalCluster
from threefs.client.client import Client
from threefs.common import limits
from threefs.common.status import StatusCode, ThreeFSError
from threefs.rpc.client import RpcClient
from threefs.rpc.frame import (KIND_REQUEST, MAGIC, PREFIX, PREFIX_BYTES, FrameError, FrameReader, Header,
                               body_encoder, encode_frame_head)
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty
from threefs.testing.fuzz import malformed_frames, random_body, service_methods

SEED = int(os.environ.get("THREEFS_TEST_SEED", "20261201"))
FRAMES = int(os.environ.get("THREEFS_FUZZ_FRAMES", "20000"))
BODIES = int(os.environ.get("THREEFS_FUZZ_BODIES", "24"))
RSS_GROWTH_MAX = 256 << 20


# -- the frame decoder, in-process ------------------------------------------------------------------------
def _valid_frame(rid: int, pad: int, plen: int) -> bytes:
    body = msgspec.Raw(body_encoder.encode({"pad": "p" * pad}))
    return encode_frame_head(Header(KIND_REQUEST, rid, method="m", body=body), plen) + b"\xab" * plen


def _feed(stream: bytes, cuts: list[int]) -> tuple[list, FrameError | None, int]:
    got, allocated = [], [0]

    def allocate(header, n):
        assert 0 < n <= limits.FRAME_PAYLOAD_BYTES_MAX
        allocated[0] = max(allocated[0], n)
        return memoryview(bytearray(n))

    reader = FrameReader(lambda h, p: got.append((h.rid, None if p is None else bytes(p))), allocate)
    pos, i = 0, 0
    try:
        while pos < len(stream):
            buf = reader.get_buffer(-1)
            assert len(buf) > 0
            n = min(len(buf), max(1, cuts[i % len(cuts)]), len(stream) - pos)
            i += 1
            buf[:n] = stream[pos:pos + n]
            pos += n
            reader.buffer_updated(n)
            # the scratch never grows past what one legal header needs
            assert len(reader._scratch) <= 2 * (limits.FRAME_HEADER_BYTES_MAX + PREFIX_BYTES)
    except FrameError as e:
        return got, e, allocated[0]
    return got, None, allocated[0]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(st.tuples(st.integers(0, 3000), st.sampled_from([0, 1, 100, 70_000])), max_size=8),
       junk=st.binary(max_size=64), cuts=st.lists(st.integers(1, 1 << 18), min_size=1, max_size=20),
       where=st.integers(0, 8))
def test_frame_reader_valid_frames_then_junk(frames, junk, cuts, where):
    """Valid frames in any fragmentation are delivered exactly; junk after them only raises FrameError."""
    good = [_valid_frame(i + 1, pad, plen) for i, (pad, plen) in enumerate(frames)]
    cut = min(where, len(good))
    stream = b"".join(good[:cut]) + junk
    got, err, _ = _feed(stream, cuts)
    assert [rid for rid, _ in got[:cut]] == list(range(1, cut + 1))
    for (rid, payload), (_, plen) in zip(got[:cut], frames):
        assert (payload or b"") == b"\xab" * plen
    if err is not None:
        assert err.code in (StatusCode.PROTOCOL_ERROR, StatusCode.FRAME_TOO_LARGE) and err.message


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(1, 5000), min_size=1, max_size=10))
def test_frame_reader_random_bytes_only_raise_frame_error(data, cuts):
    _feed(data, cuts)  # any other exception fails the test


@settings(max_examples=200, deadline=None)
@given(hlen=st.integers(0, (1 << 32) - 1), plen=st.integers(0, (1 << 64) - 1), tail=st.binary(max_size=256),
       magic_ok=st.booleans())
def test_frame_reader_random_prefixes(hlen, plen, tail, magic_ok):
    """Oversized or lying prefixes are refused before anything is allocated past the limits."""
    stream = PREFIX.pack(MAGIC if magic_ok else MAGIC ^ 1, 0, hlen, plen) + tail
    got, err, allocated = _feed(stream, [len(stream)])
    assert allocated <= limits.FRAME_PAYLOAD_BYTES_MAX
    if not magic_ok or hlen > limits.FRAME_HEADER_BYTES_MAX or plen > limits.FRAME_PAYLOAD_BYTES_MAX:
        assert err is not None and not got


# -- real services ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """A cluster of its own: the fuzzer uses the cluster token, so random admin calls may change it."""
    cluster = LocalCluster(tmp_path_factory.mktemp("fuzz"))
    try:
        cluster.up(2, 2)
        client = Client.connect(str(cluster.client_config_path))
        client.mkdir("/keep")
        client.write_bytes("/keep/data", b"precious" * 1000)
        client.mkdir("/tmp", 0o1777)
        add = client.aio.mgmtd.call("user_add", ms.UserReq("fuzzy", 1000, 1000), ms.UserTokenRsp)
        user = client.run(add)
        cluster.user_token = user.token
        yield cluster, client
        client.close()
    finally:
        cluster.down()


def _addrs(client: Client) -> dict[str, list[str]]:
    routing = client.run(client.aio.mgmtd.call("status", Empty(), ms.MgmtdStatusRsp)).routing
    out: dict[str, list[str]] = {ms.MGMTD: list(client.aio.config.mgmtd)}
    for n in routing.nodes.values():
        out.setdefault(n.type, []).append(n.addr)
    return out


def _pids(cluster) -> dict[str, int]:
    return dict(cluster.running())


def _well_formed_works(client: Client) -> None:
    assert client.read_bytes("/keep/data") == b"precious" * 1000
    assert client.stat("/keep").type == m.DIRECTORY


def _internal_errors_in_logs(cluster) -> list[str]:
    bad = []
    for log in sorted((cluster.dir / "log").glob("*.log")):
        text = log.read_text(errors="replace")
        bad += [f"{log.name}: {line}" for line in text.splitlines() if "internal error in" in line]
    return bad


async def _fuzz_methods(tokens: list[str], addrs: dict[str, list[str]], rng: random.Random,
                        stats: dict) -> None:
    """Every method of every service gets BODIES random bodies, each from the cluster token (deep paths:
    acts as root, may administer) or a user token (the permission and refusal paths)."""
    rpcs = [RpcClient(t, client_id=f"fuzzer-{i}") for i, t in enumerate(tokens)]
    try:
        for service, methods in service_methods().items():
            for method, req_type in methods:
                for addr in addrs.get(service, []):
                    calls = []
                    for _ in range(BODIES):
                        body = random_body(rng, req_type)
                        payload = rng.choice([None, None, b"", rng.randbytes(rng.choice([1, 4096]))])
                        calls.append(_one_call(rng.choice(rpcs), addr, method, body, payload, stats))
                    await asyncio.gather(*calls)
    finally:
        for rpc in rpcs:
            await rpc.close()


async def _one_call(rpc: RpcClient, addr: str, method: str, body: bytes, payload, stats: dict) -> None:
    try:
        conn = await rpc.connection(addr)
        async with asyncio.timeout(30):  # the server's own deadline is 2 s: silence past that is a hang
            await conn.request(KIND_REQUEST, method, body, payload, None, 2.0)
        code = StatusCode.OK
    except TimeoutError:
        stats["hangs"].append(method)
        return
    except ThreeFSError as e:
        code = e.code
        if code == StatusCode.INTERNAL:
            stats["internal"].append(f"{method}: {e.message}")
    stats["codes"][f"{method} {StatusCode(code).name if code in StatusCode._value2member_map_ else code}"] = 1


def test_every_rpc_method_survives_random_bodies(victim):
    cluster, client = victim
    rng = random.Random(SEED)
    addrs = _addrs(client)
    pids = _pids(cluster)
    before = {name: rss_bytes(pid) for name, pid in pids.items()}
    stats = {"hangs": [], "internal": [], "codes": {}}
    token = (cluster.dir / "token").read_text().strip()
    started = time.monotonic()
    client.run(_fuzz_methods([token, cluster.user_token], addrs, rng, stats))
    n_methods = sum(len(v) for v in service_methods().values())
    outcomes: dict[str, int] = {}
    for key in stats["codes"]:
        outcomes[key.split()[1]] = outcomes.get(key.split()[1], 0) + 1
    print(f"\nMEASURED RPC fuzz outcomes (status: methods): {outcomes}")
    print(f"MEASURED RPC fuzz: {n_methods} methods x {BODIES} bodies per service address in "
          f"{time.monotonic() - started:.1f} s; {len(stats['codes'])} distinct (method, status) outcomes")
    assert not stats["hangs"], f"no answer (hang) from: {sorted(set(stats['hangs']))}"
    assert not stats["internal"], "handler crashed:\n" + "\n".join(stats["internal"][:20])
    assert _pids(cluster) == pids, "a service process died"
    for name, pid in pids.items():
        assert rss_bytes(pid) - before[name] < RSS_GROWTH_MAX, f"{name} memory grew unboundedly"
    _well_formed_works(client)
    assert not _internal_errors_in_logs(cluster)


def _sentinel(addr_type: str, rid: int) -> bytes:
    if addr_type == ms.META:
        return request_frame(rid, "meta.stat", m.StatReq("/keep"))
    if addr_type == ms.MGMTD:
        return request_frame(rid, "mgmtd.get_primary", Empty())  # a standby answers it too
    return request_frame(rid, "storage.status", Empty())


def _until_answered(conn: RawConn, rid: int) -> None:
    while True:
        got = conn.recv_frame()
        assert got is not None, "the server closed a connection that sent only non-fatal frames"
        if got[0].rid == rid:
            assert got[0].status == 0, got[0]
            return


def _fatal_one(addr: str, token: str, frame: bytes, rng: random.Random) -> None:
    conn = RawConn(addr)
    try:
        assert conn.authenticate(token, client_id="fuzz-fatal").status == 0
        if rng.random() < 0.3:  # truncated: the client vanishes mid-frame
            conn.send(frame[:rng.randrange(1, max(2, len(frame)))])
            return
        conn.send(frame)
        assert conn.closed_by_peer()
    finally:
        conn.close()


def test_malformed_frame_stream(victim):
    """THREEFS_FUZZ_FRAMES malformed frames against meta, storage and mgmtd; each batch is followed by a
    well-formed request on the same connection, which must be answered."""
    cluster, client = victim
    rng = random.Random(SEED + 1)
    addrs = _addrs(client)
    token = (cluster.dir / "token").read_text().strip()
    methods = [name for ms_ in service_methods().values() for name, _ in ms_]
    targets = [(t, addrs[t][0]) for t in (ms.META, ms.STORAGE, ms.MGMTD)]
    pids = _pids(cluster)
    before = {name: rss_bytes(pid) for name, pid in pids.items()}
    gen = malformed_frames(rng, methods)
    conns = {t: RawConn(a) for t, a in targets}
    for t, c in conns.items():
        assert c.authenticate(token, client_id=f"fuzz-{t}").status == 0
    sent, fatal, rid, started = 0, 0, 1 << 62, time.monotonic()
    try:
        while sent < FRAMES:
            t, addr = targets[rng.randrange(len(targets))]
            batch = []
            while len(batch) < 256 and sent < FRAMES:
                is_fatal, frame = next(gen)
                if is_fatal:
                    if fatal >= 2000 and rng.random() >= 0.02:
                        continue  # each costs a connection: keep soak runs mostly in-connection frames
                    _fatal_one(addr, token, frame, rng)
                    fatal += 1
                else:
                    batch.append(frame)
                sent += 1
            rid += 1
            conns[t].send(b"".join(batch) + _sentinel(t, rid))
            _until_answered(conns[t], rid)
    finally:
        for c in conns.values():
            c.close()
    elapsed = time.monotonic() - started
    print(f"\nMEASURED frame fuzz: {sent} malformed frames ({fatal} connection-fatal) in {elapsed:.1f} s "
          f"({sent / elapsed:.0f}/s)")
    assert _pids(cluster) == pids, "a service process died"
    for name, pid in pids.items():
        assert rss_bytes(pid) - before[name] < RSS_GROWTH_MAX, f"{name} memory grew unboundedly"
    _well_formed_works(client)
    assert not _internal_errors_in_logs(cluster)
