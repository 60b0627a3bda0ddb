"""End-to-end data path on a real cluster: 3 storage processes, R=3, 1 MiB chunks."""

from __future__ import annotations

import errno
import io
import shutil

import crc32c
import pytest

from threefs.common.ids import chunk_id
from threefs.common.layout import chain_of_chunk
from threefs.common.status import StatusCode, ThreeFSError
from threefs.rpc.schemas import storage as ss

CS = 1 << 20


@pytest.fixture
def d(fs, request):
    path = f"/{request.node.name.replace('[', '_').replace(']', '')}"
    fs.mkdir(path)
    return path


def _data(rng, n: int) -> bytes:
    return rng.randbytes(n)


@pytest.mark.parametrize("size", [0, 1, CS - 1, CS, CS + 1, 5 * CS + 12345])
def test_round_trip_sizes(fs, d, rng, size):
    data = _data(rng, size)
    with fs.open(f"{d}/f", "wb") as f:
        f.write(data)
    assert fs.stat(f"{d}/f").length == size
    assert fs.read_bytes(f"{d}/f") == data
    # random ranges through the raw file and through batch_read
    with fs.open(f"{d}/f", "rb", buffering=0) as f:
        for _ in range(20):
            off = rng.randrange(0, size + 2)
            n = rng.randrange(0, 3 * CS)
            f.seek(off)
            assert f.read(n) == data[off:off + n]
    bufs = [bytearray(rng.randrange(1, 2 * CS)) for _ in range(8)]
    offs = [rng.randrange(0, size + 1) for _ in bufs]
    got = fs.batch_read([(f"{d}/f", o, b) for o, b in zip(offs, bufs)])
    for o, b, n in zip(offs, bufs, got):
        assert n == len(data[o:o + len(b)])
        assert bytes(b[:n]) == data[o:o + n]


def test_overwrite_in_the_middle_and_random_offsets(fs, d, rng):
    size = 4 * CS + 100
    model = bytearray(_data(rng, size))
    with fs.open(f"{d}/f", "wb") as f:
        f.write(model)
    with fs.open(f"{d}/f", "r+b", buffering=0) as f:
        for _ in range(15):
            off = rng.randrange(0, size)
            piece = _data(rng, rng.randrange(1, CS + 5000))
            f.seek(off)
            f.write(piece)
            end = off + len(piece)
            if end > len(model):
                model.extend(bytes(end - len(model)))
            model[off:end] = piece
    assert fs.stat(f"{d}/f").length == len(model)
    assert fs.read_bytes(f"{d}/f") == bytes(model)


def test_sparse_write_reads_zeros(fs, d):
    with fs.open(f"{d}/f", "wb", buffering=0) as f:
        f.seek(3 * CS + 10)
        f.write(b"end")
    data = fs.read_bytes(f"{d}/f")
    assert len(data) == 3 * CS + 13 and data[:-3] == bytes(3 * CS + 10) and data[-3:] == b"end"


def test_all_replicas_identical(fs, d, rng):
    data = _data(rng, 3 * CS + 777)
    fs.write_bytes(f"{d}/f", data)
    attr = fs.stat(f"{d}/f")
    aio = fs.aio

    async def check():
        routing = await aio.mgmtd.refresh(force=True)
        table = routing.table(attr.layout.table_id).chains
        for index in range(4):
            chain = routing.chain(chain_of_chunk(attr.layout, index, table))
            assert len(chain.targets) == 3
            expected = data[index * CS:(index + 1) * CS]
            seen = set()
            for t in chain.targets:
                io_ = ss.ReadIO(chain.chain_id, t.target_id, chunk_id(attr.inode, index), 0, CS)
                rsp, payload = await aio.rpc.call(routing.target_addr(t.target_id), "storage.batch_read",
                                                  ss.BatchReadReq([io_]), ss.BatchReadRsp)
                r = rsp.results[0]
                assert r.status == 0 and bytes(payload) == expected
                assert r.chunk_crc == crc32c.crc32c(expected)
                seen.add((r.commit_ver, r.chunk_crc))
            assert len(seen) == 1, f"replicas of chunk {index} differ: {seen}"

    fs.run(check())


def test_file_objects_work_with_shutil_and_buffered_io(fs, d, rng, tmp_path):
    src = tmp_path / "src.bin"
    data = _data(rng, 2 * CS + 333)
    src.write_bytes(data)
    with open(src, "rb") as s, fs.open(f"{d}/copy", "wb") as t:
        shutil.copyfileobj(s, t, 256 * 1024)
    with fs.open(f"{d}/copy", "rb") as f:
        assert isinstance(f, io.IOBase) and f.readable() and f.seekable()
        assert f.read(10) == data[:10]
        f.seek(-5, io.SEEK_END)
        assert f.read() == data[-5:]
    with fs.open(f"{d}/copy", "ab") as f:
        f.write(b"tail")
    assert fs.read_bytes(f"{d}/copy") == data + b"tail"


def test_pyarrow_reads_a_threefs_file(fs, d):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"x": list(range(1000)), "y": [str(i) for i in range(1000)]})
    with fs.open(f"{d}/t.parquet", "wb") as f:
        pq.write_table(table, f)
    with fs.open(f"{d}/t.parquet", "rb") as f:
        assert pq.read_table(f).equals(table)


def test_namespace_semantics_and_errnos(fs, d):
    fs.mkdir(f"{d}/a/b", parents=True)
    fs.write_bytes(f"{d}/a/b/f", b"x")
    with pytest.raises(FileExistsError):
        fs.mkdir(f"{d}/a")
    with pytest.raises(FileExistsError):
        fs.open(f"{d}/a/b/f", "xb")
    with pytest.raises(FileNotFoundError):
        fs.stat(f"{d}/nope")
    with pytest.raises(FileNotFoundError):
        fs.open(f"{d}/nope", "rb")
    with pytest.raises(OSError) as ei:
        fs.rmdir(f"{d}/a")
    assert ei.value.errno == errno.ENOTEMPTY
    with pytest.raises(IsADirectoryError):
        fs.remove(f"{d}/a")
    with pytest.raises(NotADirectoryError):
        fs.rmdir(f"{d}/a/b/f")
    with pytest.raises(NotADirectoryError):
        fs.stat(f"{d}/a/b/f/x")
    with pytest.raises(OSError) as ei:
        fs.rename(f"{d}/a", f"{d}/a/b/inside")
    assert ei.value.errno == errno.EINVAL
    # rename replaces a file atomically; the old target's data goes away
    fs.write_bytes(f"{d}/a/other", b"other")
    fs.rename(f"{d}/a/b/f", f"{d}/a/other")
    assert fs.read_bytes(f"{d}/a/other") == b"x"
    assert sorted(fs.listdir(f"{d}/a")) == ["b", "other"]
    fs.rename(f"{d}/a/b", f"{d}/moved")
    assert fs.listdir(f"{d}/moved") == []
    fs.remove(f"{d}/a/other")
    fs.rmdir(f"{d}/a")
    assert fs.listdir(d) == ["moved"]


def test_truncate_on_open_drops_old_data(fs, d, rng):
    fs.write_bytes(f"{d}/f", _data(rng, 3 * CS))
    fs.write_bytes(f"{d}/f", b"short")
    assert fs.read_bytes(f"{d}/f") == b"short"
    with fs.open(f"{d}/f", "r+b", buffering=0) as f:
        f.seek(2 * CS)
        f.write(b"z")
    data = fs.read_bytes(f"{d}/f")
    assert data[:5] == b"short" and data[5:-1] == bytes(2 * CS - 5) and data[-1:] == b"z"


def test_bad_input_gets_clear_errors(fs, d):
    with pytest.raises(ThreeFSError) as ei:
        fs.open(f"{d}/f", "rwb")  # no such mode
    assert ei.value.code == StatusCode.INVALID_ARGUMENT
    with pytest.raises(ThreeFSError) as ei:
        fs.stat("relative/path")
    assert ei.value.code in (StatusCode.INVALID_PATH, StatusCode.INVALID_ARGUMENT)
    with pytest.raises(ThreeFSError) as ei:
        fs.mkdir(f"{d}/" + "n" * 300)
    assert ei.value.code == StatusCode.NAME_TOO_LONG
    assert fs.stat(d).type == 2  # still serving


def test_wrong_token_is_refused(cluster):
    from threefs.client.client import Client
    from threefs.common.config import ClientConfig, load_toml

    cfg = load_toml(cluster.client_config_path, ClientConfig)
    cfg.token = "0" * 64
    with pytest.raises(ThreeFSError) as ei:
        Client.connect(cfg)
    assert ei.value.code in (StatusCode.AUTH_FAILED, StatusCode.UNAVAILABLE)
    assert "token" in str(ei.value)


def test_many_small_batch_reads(fs, d, rng):
    data = _data(rng, 2 * CS)
    fs.write_bytes(f"{d}/f", data)
    items = []
    for _ in range(2000):
        off = rng.randrange(0, len(data) - 4096)
        items.append((f"{d}/f", off, bytearray(4096)))
    got = fs.batch_read(items)
    assert all(n == 4096 for n in got)
    for (_, off, buf) in items:
        assert bytes(buf) == data[off:off + 4096]


def test_create_truncating_an_existing_file_removes_its_data(fs, d, rng):
    """open(O_CREAT|O_TRUNC) ("wb") of a name that exists: meta's open first tries it as a create, finds the
    file and plans the truncate (its chunks go before the length does), so the old bytes never come back
    when the file grows again; of a new name it creates the file."""
    old = _data(rng, 3 * CS + 77)
    fs.write_bytes(f"{d}/f", old)
    fs.write_bytes(f"{d}/f", b"short")  # O_CREAT|O_TRUNC of an existing file
    assert fs.read_bytes(f"{d}/f") == b"short"
    fs.truncate(f"{d}/f", len(old))  # grown again: zeros, not the old chunks
    assert fs.read_bytes(f"{d}/f") == b"short" + bytes(len(old) - 5)
    fs.write_bytes(f"{d}/new", b"x")  # and of a new name
    assert fs.read_bytes(f"{d}/new") == b"x" and fs.stat(f"{d}/new").length == 1


def test_read_answers_carry_no_stale_pool_bytes(fs, d, rng):
    """A storage read answer is a pooled buffer that held earlier answers (other files' bytes): alignment pads
    between slots, the slots of failed IOs and the tails of short reads are sent as zeros, on the packed path
    and the per-IO one. Each is asked right after an answer that filled the same pooled buffer with data."""
    data = bytes(b | 1 for b in _data(rng, 2 * CS))  # no zero byte: a stale byte cannot pass for a zero
    fs.write_bytes(f"{d}/f", data)
    attr = fs.stat(f"{d}/f")
    aio = fs.aio

    async def check():
        routing = await aio.mgmtd.refresh(force=True)
        chain = routing.chain(chain_of_chunk(attr.layout, 0, routing.table(attr.layout.table_id).chains))
        target = chain.targets[0].target_id
        addr, cid = routing.target_addr(target), chunk_id(attr.inode, 0)

        def packed(ios):
            return ss.PackedReadReq(b"".join(ss_pack_io(chain.chain_id, t, c, o, n) for t, c, o, n in ios))

        for _ in range(3):
            # fill the pool's buffer of this size with file bytes
            await aio.rpc.call(addr, "storage.read_packed", packed([(target, cid, 0, 16 * 1024)]),
                               ss.PackedReadRsp)
            ios = [(target, cid, 0, 100),            # slot [0, 128): 100 bytes, then a 28-byte pad
                   (target + 10_000, cid, 0, 4096),  # slot [128, 4224): a target not here: an error
                   (target, cid, CS - 50, 4000),     # slot [4224, 8256): 50 bytes, the end of the chunk
                   (target, cid, 4096, 4096)]        # slot [8256, 12352): 4096 bytes
            rsp, payload = await aio.rpc.call(addr, "storage.read_packed", packed(ios), ss.PackedReadRsp)
            body = bytes(payload)
            assert body[:100] == data[:100] and body[100:128] == bytes(28)
            assert body[128:4224] == bytes(4096), "a failed IO's slot carries stale bytes"
            assert body[4224:4274] == data[CS - 50:CS] and body[4274:8256] == bytes(3982)
            assert body[8256:12352] == data[4096:8192]

            # the per-IO path (storage.batch_read): slots packed after each result, pads between them
            await aio.rpc.call(addr, "storage.batch_read", ss.BatchReadReq(
                [ss.ReadIO(chain.chain_id, target, cid, 0, 16 * 1024)]), ss.BatchReadRsp)
            rsp, payload = await aio.rpc.call(addr, "storage.batch_read", ss.BatchReadReq(
                [ss.ReadIO(chain.chain_id, target, cid, 0, 100), ss.ReadIO(chain.chain_id, target, cid, 200, 64)]),
                ss.BatchReadRsp)
            body = bytes(payload)
            assert [r.length for r in rsp.results] == [100, 64]
            assert body[:100] == data[:100] and body[100:128] == bytes(28) and body[128:192] == data[200:264]

    fs.run(check())


def ss_pack_io(chain_id: int, target_id: int, cid: bytes, offset: int, length: int) -> bytes:
    import struct

    return struct.pack(ss.READ_IO_FORMAT, chain_id, target_id, cid, offset, length)
