"""Meta under failure, on private clusters: kill -9 a meta server mid-workload; GC gives space back on
storage; the write sessions of a client that died are pruned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import urllib.request

import msgspec
import pytest

from threefs.client.client import Client
from threefs.cluster.routing import write_targets
from threefs.common.ids import inode_chunk_range
from threefs.common.status import StatusCode, ThreeFSError
from threefs.rpc.schemas import meta as m
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss
from threefs.testing.checks import wait_for

MiB = 1 << 20



def test_kill9_meta_mid_workload(private_cluster):
    """A thread creates and renames files while meta-1 is killed: every call succeeds (failover to
    meta-2, retries answered from the idempotency records), and the namespace is exactly what it did."""
    cluster = private_cluster(meta=2)
    done, errors = [], []
    stop = threading.Event()

    def workload(fs: Client):
        for i in range(10_000):  # bounded; stopped by the main thread
            if stop.is_set():
                return
            try:
                with fs.open(f"/w/f{i}", "xb") as f:
                    f.write(b"%d" % i)
                fs.rename(f"/w/f{i}", f"/w/g{i}")
                done.append(i)
            except ThreeFSError as e:
                errors.append(f"{i}: {e}")
                return

    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/w")
        _same_reply_from_both_servers(fs)
        worker = threading.Thread(target=workload, args=(fs,))
        worker.start()
        wait_for(lambda: len(done) >= 20, "the workload to get going", 60, interval=0.2)
        cluster.kill("meta-1")
        seen = len(done)
        wait_for(lambda: len(done) >= seen + 40 or errors, "the workload to go on after the kill", 60, interval=0.2)
        stop.set()
        worker.join(60)
        assert not errors, errors
        names = sorted(fs.listdir("/w"))
        assert names == sorted(f"g{i}" for i in done)
        for i in done[-5:]:
            assert fs.read_bytes(f"/w/g{i}") == b"%d" % i


def _same_reply_from_both_servers(fs: Client) -> None:
    """A create retried on the other meta server (same client, same request id), as after a lost reply:
    the second server answers with the first reply instead of EEXIST."""
    servers = [n.addr for n in fs.run(fs.aio.mgmtd.refresh(force=True)).nodes_of_type(ms.META)]
    assert len(servers) == 2
    req = m.OpenReq("/w/once", os.O_CREAT | os.O_EXCL | os.O_WRONLY, request_id=1 << 40)
    replies = [fs.run(fs.aio.rpc.call(addr, "meta.open", req, m.OpenRsp))[0] for addr in servers]
    # the same reply, but for the directory the first one changed: the retry changed none (and the
    # directory may have changed since), so it does not say what the directory is now
    assert len(replies[0].parents) == 1 and replies[1].parents == []
    assert msgspec.structs.replace(replies[0], parents=[]) == replies[1] and replies[0].session
    fs.run(fs.aio.close_file(replies[0].attr.inode, replies[0].session, -1))
    fs.remove("/w/once")


def _used(fs: Client) -> int:
    return fs.statfs().used_bytes


def test_gc_returns_space_and_dead_writers_are_pruned(private_cluster, tmp_path):
    cluster = private_cluster(meta_gc_delay_s=0.0, client_session_timeout_s=3.0)
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/big/tree", parents=True)
        for i in range(4):
            fs.write_bytes(f"/big/tree/f{i}", os.urandom(2 * MiB))
        fs.write_bytes("/big/single", os.urandom(3 * MiB))
        wait_for(lambda: _used(fs) >= 11 * MiB, "storage to report the data", 30, interval=0.2)
        fs.remove("/big/single")
        fs.remove_tree("/big/tree")
        wait_for(lambda: _used(fs) < MiB, "GC to remove the chunks on storage", 60, interval=0.2)

        # a writer that dies (kill -9) with its file open: its session holds the unlinked file back,
        # until meta prunes it; its length is measured from storage first
        script = ("import sys, time; from threefs.client.client import Client\n"
                  "fs = Client.connect(sys.argv[1]); f = fs.open('/dead', 'wb', buffering=0)\n"
                  "f.write(b'z' * 3000000); print('ready', flush=True); time.sleep(600)\n")
        child = subprocess.Popen([sys.executable, "-c", script, str(cluster.client_config_path)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            assert fs.stat("/dead").length == 0  # lazy: never reported
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(10)
        wait_for(lambda: fs.stat("/dead").length == 3_000_000, "the dead writer's length to be measured", 60, interval=0.2)
        wait_for(lambda: _used(fs) >= 3_000_000, "storage to report the data", 30, interval=0.2)
        fs.remove("/dead")
        wait_for(lambda: _used(fs) < MiB, "GC of the dead writer's file", 60, interval=0.2)


def _requests(cluster, method: str, status: str = "OK") -> int:
    """A method's requests answered with `status`, summed over the storage services' /metrics."""
    total = 0
    for name, port in cluster.existing_spec().metrics_ports.items():
        if name.startswith("storage-"):
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            line = f'threefs_rpc_requests_total{{method="{method}",status="{status}"}} '
            total += sum(int(float(x.split()[-1])) for x in text.splitlines() if x.startswith(line))
    return total


def test_gc_of_many_files_sends_one_request_per_chain_and_pass(private_cluster, rng):
    """GC of many unlinked files (empty, one chunk, several chunks) removes all their chunks with one
    storage.remove_ranges request per chain for a whole pass, where it sent one remove_range per file and
    chain; remove_ranges refuses bad input with a message."""
    cluster = private_cluster(meta_gc_delay_s=0.0)
    with Client.connect(str(cluster.client_config_path)) as fs:
        fs.mkdir("/many")
        chunk = fs.stat("/many").layout.chunk_size
        sizes = [0] * 150 + [rng.randint(1, 8192) for _ in range(45)] + [2 * chunk + 5] * 3
        rng.shuffle(sizes)
        for i, size in enumerate(sizes):
            fs.write_bytes(f"/many/f{i}", os.urandom(size))
        inodes = [fs.stat(f"/many/f{i}").inode for i in range(len(sizes))]
        routing = fs.run(fs.aio.mgmtd.refresh(force=True))
        chains = routing.table(1).chains

        def chunks_left() -> int:  # of the first file that still has any, on any chain (0: none left)
            for inode in inodes:
                begin, end = inode_chunk_range(inode)
                for c in chains:
                    if fs.run(fs.aio.storage.last_chunk(c, begin, end)).chunk_id:
                        return inode
            return 0

        assert chunks_left()
        fs.remove_tree("/many")  # all files reach the GC queue at once (a pass takes 128 of them)
        wait_for(lambda: not chunks_left(), "GC to remove every chunk of the files", 60, interval=0.3)
        assert _requests(cluster, "storage.remove_range") == 0
        batched = _requests(cluster, "storage.remove_ranges")
        # one per chain and pass: each of the 2 meta servers collects its share of the 128 oldest files per
        # pass, so a few passes of 4 chains; one request per file and chain would be 4 * 198
        assert 0 < batched < len(sizes) // 2, (batched, len(sizes), len(chains))

        chain = routing.chain(chains[0])
        head = routing.target_addr(write_targets(chain)[0])

        def remove_ranges(ranges):
            req = ss.RemoveRangesReq(chain.chain_id, chain.version, ranges, chunk)
            return fs.run(fs.aio.rpc.call(head, "storage.remove_ranges", req, ss.RemoveRangeRsp))[0]

        assert remove_ranges([]).removed == 0
        with pytest.raises(ThreeFSError) as e:
            remove_ranges([(b"\x00" * 16, b"\xff" * 16)] * (ss.REMOVE_RANGES_MAX + 1))
        assert e.value.code == StatusCode.INVALID_ARGUMENT and "at most 1024" in e.value.message
        with pytest.raises(ThreeFSError) as e:
            remove_ranges([(b"\x02" * 16, b"\x01" * 16)])
        assert e.value.code == StatusCode.INVALID_ARGUMENT and "begins after its end" in e.value.message
