"""Cluster-level checks shared by the fault tests and the benchmarks."""

from __future__ import annotations

import time

from threefs.common import crc32c
from threefs.common.ids import chunk_id
from threefs.common.layout import chain_of_chunk
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas import storage as ss


def wait_for(predicate, what: str, timeout: float = 30.0, interval: float = 0.05):
    """Poll until predicate() is truthy; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def stat_answers(fs, path: str) -> bool:
    """Does a stat of `path` get an answer (True), or UNAVAILABLE (False: no meta server answers yet)?
    Any other error is raised."""
    from threefs.common.status import StatusCode, ThreeFSError

    try:
        fs.stat(path)
        return True
    except ThreeFSError as e:
        if e.code != StatusCode.UNAVAILABLE:
            raise
        return False


def routing(fs) -> ms.RoutingInfo:
    return fs.run(fs.aio.mgmtd.refresh(force=True)).info


def all_serving(fs) -> bool:
    return all(t.public_state == ms.SERVING for t in routing(fs).targets.values() if t.chain_id)


def replica_differences(fs, path: str) -> list[str]:
    """Read every chunk of `path` from every target of its chain; describe any disagreement."""
    attr = fs.stat(path)
    cs = attr.layout.chunk_size

    async def check() -> list[str]:
        info = await fs.aio.mgmtd.refresh(force=True)
        table = info.table(attr.layout.table_id).chains
        problems = []
        for index in range(-(-attr.length // cs)):
            chain = info.chain(chain_of_chunk(attr.layout, index, table))
            seen = {}
            for t in chain.targets:
                io = ss.ReadIO(chain.chain_id, t.target_id, chunk_id(attr.inode, index), 0, cs)
                rsp, payload = await fs.aio.rpc.call(info.target_addr(t.target_id), "storage.batch_read",
                                                     ss.BatchReadReq([io]), ss.BatchReadRsp)
                r = rsp.results[0]
                data = bytes(payload[:r.length]) if payload is not None else b""
                if r.status or crc32c.crc32c(data) != r.chunk_crc and r.length:
                    problems.append(f"{path} chunk {index} target {t.target_id}: status {r.status} "
                                    f"{r.message}")
                seen[t.target_id] = (r.commit_ver, crc32c.crc32c(data), len(data))
            if len(set(seen.values())) > 1:
                problems.append(f"{path} chunk {index} differs across replicas: {seen}")
        return problems

    return fs.run(check())
