"""Packed reads of big IOs received straight into each IO's own destination (frame.Scatter), against a
scripted storage answer fed through the client's real frame reader in random fragments: the bytes of good
IOs, zeros for holes and short reads, errors with zeroed destinations (never the bytes the server had in an
error's slot, nor bytes damaged on the way), the alignment padding never in the caller's memory, and a call
that fails midway leaves no bytes of another IO behind."""

from __future__ import annotations

import asyncio
import random
import types

import crc32c
import numpy as np
import pytest

from threefs.cluster.storage_client import IO_DTYPE, RESULT_DTYPE, ReadBatch, StorageClient, _aligned
from threefs.common.status import StatusCode, status_error
from threefs.rpc.client import ClientConnection, _Pending
from threefs.rpc.frame import FrameReader, Header, Scatter, encode_frame_head
from threefs.rpc.schemas import storage as ss

KiB = 1 << 10
LENGTHS = [64 * KiB, 40001, 64 * KiB, 64 * KiB, 48 * KiB, 64 * KiB]  # (40001: a slot with padding)
OK, UNALIGNED, REFUSED, DAMAGED, SHORT, HOLE = range(6)


def _script(rng: random.Random):
    """(data per IO, results, payload): what a server answers for LENGTHS, slot by slot."""
    data = [rng.randbytes(n) for n in LENGTHS]
    ends = np.cumsum(_aligned(np.array(LENGTHS))).tolist()
    res = np.zeros(len(LENGTHS), dtype=RESULT_DTYPE)
    payload = bytearray(b"\xee" * ends[-1])  # what the server's buffer held before (its padding, its tails)
    for k, n in enumerate(LENGTHS):
        s = ends[k] - int(_aligned(np.array([n]))[0])
        got = {REFUSED: 0, SHORT: 1000, HOLE: 0}.get(k, n)
        if k == REFUSED:  # an error's slot is not written by the server: another IO's bytes from before
            payload[s:s + n] = data[OK][:n]
            res[k]["status"] = StatusCode.CHUNK_NOT_COMMIT
            continue
        payload[s:s + got] = data[k][:got]
        res[k]["length"] = got
        res[k]["data_crc"] = crc32c.crc32c(data[k][:got])
        if k == DAMAGED:
            payload[s + 777] ^= 0x10  # damaged on the way, after the server's crc32c
    trimmed = ends[SHORT]  # the server trims the payload after the last byte sent (the hole sends none)
    rsp = ss.PackedReadRsp(res.tobytes(), {REFUSED: "chunk has a pending update"})
    return data, rsp, bytes(payload[:trimmed])


class _Storage(StorageClient):
    """A storage client whose read_packed calls are answered by the script, through the real receive path
    (ClientConnection.allocate_payload, FrameReader) in random fragments."""

    def __init__(self, rsp, payload, rng, fail_after: int | None = None):
        super().__init__(types.SimpleNamespace(senders=None), None)
        self.answer, self.rng, self.fail_after = (rsp, payload), rng, fail_after
        self.received_into = []

    async def _call(self, addr, method, req, rsp_type, *, recv_into=None, **kwargs):
        self.received_into.append(type(recv_into))
        rsp, payload = self.answer
        conn = ClientConnection(addr)
        conn.pending[5] = _Pending(asyncio.get_running_loop().create_future(), recv_into)
        got = []
        reader = FrameReader(lambda h, p: got.append(p), conn.allocate_payload)
        stream = encode_frame_head(Header(1, 5), len(payload)) + payload
        pos, end = 0, len(stream) if self.fail_after is None else self.fail_after
        while pos < end:
            buf = reader.get_buffer(-1)
            n = min(len(buf), self.rng.choice([1, 100, 4096, 65536, 1 << 20]), end - pos)
            buf[:n] = stream[pos:pos + n]
            pos += n
            reader.buffer_updated(n)
        if self.fail_after is not None:
            raise status_error(StatusCode.TIMEOUT, f"{method} to {addr} timed out")
        return rsp, got[0]


def _batch(check_arrival: bool) -> ReadBatch:
    ios = np.zeros(len(LENGTHS), dtype=IO_DTYPE)
    ios["length"] = LENGTHS
    ios["chain"], ios["target"] = 1, 101
    dests = [memoryview(np.full(n, 0xAB, dtype=np.uint8)).cast("B") for n in LENGTHS]  # separate buffers
    batch = ReadBatch(ios, dests, range(len(LENGTHS)), [0] * len(LENGTHS))
    batch.check_arrival = check_arrival
    return batch


@pytest.mark.parametrize("check_arrival", [True, False])
def test_big_ios_are_received_into_their_own_destinations(check_arrival):
    rng = random.Random(5)
    for _ in range(8):
        data, rsp, payload = _script(rng)
        storage = _Storage(rsp, payload, rng)
        batch = _batch(check_arrival)
        asyncio.run(storage._read_packed("s1", batch, np.arange(len(LENGTHS)), False))
        assert storage.received_into == [Scatter]  # straight into the destinations, no pooled buffer
        assert not storage.pool._free
        dest = [bytes(d) for d in batch.dests]
        assert dest[OK] == data[OK] and dest[UNALIGNED] == data[UNALIGNED]  # (its padding went elsewhere)
        assert batch.got[OK] == LENGTHS[OK] and batch.got[UNALIGNED] == LENGTHS[UNALIGNED]
        assert batch.errors[REFUSED].code == StatusCode.CHUNK_NOT_COMMIT
        assert dest[REFUSED] == bytes(LENGTHS[REFUSED])  # not IO 0's bytes that were in its slot
        assert batch.got[SHORT] == 1000 and dest[SHORT] == data[SHORT][:1000] + bytes(LENGTHS[SHORT] - 1000)
        assert batch.got[HOLE] == 0 and dest[HOLE] == bytes(LENGTHS[HOLE])
        # (checked whatever check_arrival says, as when packed IOs were copied out of one buffer)
        assert batch.errors[DAMAGED].code == StatusCode.CHECKSUM_MISMATCH
        assert dest[DAMAGED] == bytes(LENGTHS[DAMAGED]) and storage.damaged_reads == 1
        assert set(batch.errors) == {REFUSED, DAMAGED}


def test_a_call_failing_midway_leaves_no_other_ios_bytes():
    rng = random.Random(6)
    data, rsp, payload = _script(rng)
    head = len(encode_frame_head(Header(1, 5), len(payload)))
    slot = int(_aligned(np.array(LENGTHS[:REFUSED])).sum())  # where the refused IO's slot starts
    for fail_after in (head + slot + 5000, head + len(payload) - 10):
        storage = _Storage(rsp, payload, rng, fail_after)
        batch = _batch(True)
        asyncio.run(storage._read_packed("s1", batch, np.arange(len(LENGTHS)), False))
        assert storage.received_into == [Scatter]
        assert set(batch.errors) == set(range(len(LENGTHS)))
        assert all(e.code == StatusCode.TIMEOUT for e in batch.errors.values())
        for k, d in enumerate(batch.dests):
            assert bytes(d) == bytes(LENGTHS[k]), k  # zeros, whatever had arrived


def test_small_ios_still_go_through_one_buffer():
    rng = random.Random(7)
    data, rsp, payload = _script(rng)
    storage = _Storage(rsp, payload, rng)
    batch = _batch(True)
    batch.ios["length"][HOLE] = 4 * KiB  # one small IO: the request is copied out of a pooled buffer
    batch.dests[HOLE] = batch.dests[HOLE][:4 * KiB]
    asyncio.run(storage._read_packed("s1", batch, np.arange(len(LENGTHS)), False))
    assert storage.received_into == [memoryview]


def test_caller_thread_path_failing_midway_leaves_no_other_ios_bytes():
    """The same on the caller-thread path (client/storage_sync.py): a connection that breaks after the
    refused IO's slot (another IO's bytes) came in leaves every destination of the request zeroed."""
    from threefs.client.storage_sync import SyncStorageReads
    from threefs.rpc.blocking import Broken

    rng = random.Random(8)
    data, rsp, payload = _script(rng)
    arrived = int(_aligned(np.array(LENGTHS[:REFUSED + 1])).sum()) + 7000

    class Conn:
        def receive(self, expect):
            (target,) = expect.values()
            assert type(target) is Scatter
            at = 0
            for part in target.parts:  # what arrived before the connection broke
                n = max(0, min(len(part), arrived - at))
                part[:n] = payload[at:at + n]
                at += len(part)
            raise Broken("connection reset by peer")

    storage = StorageClient(types.SimpleNamespace(senders=None), None)
    batch = _batch(True)
    idx = np.arange(len(LENGTHS))
    lengths = batch.ios["length"].astype(np.int64)
    sent = ({1: (idx, lengths, np.cumsum(_aligned(lengths)), True)}, None)
    assert SyncStorageReads._receive(None, "s1", Conn(), [idx], sent, batch, storage) is False
    assert set(batch.errors) == set(range(len(LENGTHS)))
    assert all(e.code == StatusCode.UNAVAILABLE for e in batch.errors.values())
    for k, d in enumerate(batch.dests):
        assert bytes(d) == bytes(LENGTHS[k]), k
