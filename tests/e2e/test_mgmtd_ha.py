"""mgmtd with real processes: the primary is killed, a storage service is killed and restarted.

Timings are measured and printed (run with -s to see them); tests never assert on elapsed time, they wait
for conditions with generous deadlines.
"""

from __future__ import annotations

import re
import time
import urllib.request

from threefs.cli.main import main
from threefs.cli.status import gather, render_text, watch_status
from threefs.client.client import Client
from threefs.rpc.schemas import mgmtd as ms
from threefs.rpc.schemas.common import Empty
from threefs.testing import checks

CS = 1 << 20
DEADLINE_S = 30.0


def wait_for(predicate, what: str, timeout: float = DEADLINE_S, interval: float = 0.05):
    return checks.wait_for(predicate, what, timeout, interval)


def status(fs: Client) -> ms.MgmtdStatusRsp:
    return fs.run(fs.aio.mgmtd.call("status", Empty(), ms.MgmtdStatusRsp))


def probe(fs: Client, addr: str) -> ms.PrimaryRsp | None:
    try:
        rsp, _ = fs.run(fs.aio.rpc.call(addr, "mgmtd.get_primary", Empty(), ms.PrimaryRsp, timeout=1.0))
        return rsp
    except OSError:
        return None


def write_files(fs: Client, rng, prefix: str, n: int, size_max: int) -> dict[str, bytes]:
    fs.mkdir(prefix, exist_ok=True)
    files = {}
    for i in range(n):
        data = rng.randbytes(rng.randrange(1, size_max))
        fs.write_bytes(f"{prefix}/f{i}", data)
        files[f"{prefix}/f{i}"] = data
    return files


def check_files(fs: Client, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        assert fs.read_bytes(path) == data, path


def metric(url: str, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`, from a real scrape."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:]+)(\{.*\})? ([0-9.e+-]+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def test_kill_primary_mgmtd_standby_takes_over(private_cluster, rng):
    cluster = private_cluster()
    with Client.connect(str(cluster.client_config_path)) as fs:
        files = write_files(fs, rng, "/ha", 4, 2 * CS)
        before = status(fs)
        old = before.primary
        survivor = next(a for a in fs.aio.config.mgmtd if a != old.addr)
        killed_at = time.monotonic()
        cluster.kill(f"mgmtd-{old.node_id}")
        rounds = 0
        while not (p := probe(fs, survivor)) or not p.is_primary:  # IO goes on meanwhile: only retries
            fs.write_bytes(f"/ha/during{rounds}", b"x" * 1000)
            assert fs.read_bytes("/ha/f0") == files["/ha/f0"]
            rounds += 1
            assert time.monotonic() - killed_at < DEADLINE_S, "no standby became primary"
        takeover_s = time.monotonic() - killed_at
        files.update({f"/ha/during{i}": b"x" * 1000 for i in range(rounds)})
        # after the new primary's bootstrapping, nobody was failed: storage and meta heartbeat to it
        after = wait_for(lambda: (st := status(fs)) and not st.routing.bootstrapping and st,
                         "the new primary to finish bootstrapping")
        assert after.primary.node_id != old.node_id and after.routing.version > before.routing.version
        assert all(n.alive for n in after.routing.nodes.values())
        assert all(t.public_state == ms.SERVING for c in after.routing.chains.values() for t in c.targets)
        check_files(fs, files)
        # the old primary comes back as a standby
        cluster.up()
        back = wait_for(lambda: probe(fs, old.addr), "the restarted mgmtd to answer")
        assert not back.is_primary and back.primary_id == after.primary.node_id
        # metrics: a real scrape of the new primary and of a storage service
        new_name = f"mgmtd-{after.primary.node_id}"
        assert metric(cluster.metrics_url(new_name), "threefs_mgmtd_primary") == 1
        assert metric(cluster.metrics_url(new_name), "threefs_chains", health="serving") == len(
            after.routing.chains)
        storage_url = cluster.metrics_url("storage-1")
        assert metric(storage_url, "threefs_rpc_requests_total", method="storage.update", status="OK") > 0
        assert metric(storage_url, "threefs_rpc_payload_bytes_total", direction="in") > 0
        assert metric(storage_url, "threefs_storage_fenced") == 0
    print(f"\nMEASURED mgmtd failover: standby primary {takeover_s:.2f} s after kill -9 "
          f"({rounds} client write+read rounds meanwhile, all succeeded)")


def test_kill_storage_status_shows_it_then_resync(private_cluster, rng, capsys):
    cluster = private_cluster()
    config = str(cluster.client_config_path)
    with Client.connect(config) as fs:
        files = write_files(fs, rng, "/st", 4, 2 * CS)
        base = {c.chain_id: c.version for c in status(fs).routing.chains.values()}
        dead = 102
        killed_at = time.monotonic()
        cluster.kill("storage-2")

        def left_serving():
            st = status(fs)
            return all(t.public_state != ms.SERVING for t in st.routing.targets.values() if t.node_id == dead)

        wait_for(left_serving, "the killed node's targets to leave SERVING")
        offline_s = time.monotonic() - killed_at
        capsys.readouterr()
        assert main(["--config", config, "status"]) == 0
        text = capsys.readouterr().out
        assert f"storage node {dead}" in text and "stopped sending heartbeats" in text
        assert "degraded" in text and "FAILED" in text
        files.update(write_files(fs, rng, "/st2", 6, 2 * CS))  # the restarted targets must resync these
        restarted_at = time.monotonic()
        cluster.up()
        seen: dict[int, list[str]] = {}
        shown: list[str] = []  # what `threefs status` said while a target was resyncing

        def all_serving():
            st, mgmtds, down = fs.run(gather(fs.aio))  # what `threefs status` renders
            if not shown and any(t.public_state == ms.SYNCING for t in st.routing.targets.values()):
                shown.extend(line for line in render_text(st, mgmtds, down).splitlines() if "resyncing" in line)
            for t in st.routing.targets.values():
                if t.node_id == dead and (not seen.get(t.target_id) or seen[t.target_id][-1] != t.public_state):
                    seen.setdefault(t.target_id, []).append(t.public_state)
            return all(t.public_state == ms.SERVING for c in st.routing.chains.values() for t in c.targets) and st

        final = wait_for(all_serving, "the restarted targets to resync and serve", interval=0.02)
        serving_s = time.monotonic() - restarted_at
        # OFFLINE -> SERVING is impossible without SYNCING: each chain moved at least 3 versions
        assert all(c.version >= base[c.chain_id] + 3 for c in final.routing.chains.values())
        assert main(["--config", config, "status", "--json"]) == 0
        assert '"problems": []' in capsys.readouterr().out
        assert watch_status(fs, 0.2, rounds_max=2) == 0
        assert capsys.readouterr().out.count("OK: every node alive") == 2
        check_files(fs, files)
    print(f"\nMEASURED storage kill -9: targets left SERVING after {offline_s:.2f} s (timeout 3 s); restart "
          f"-> all SERVING after {serving_s:.2f} s; states seen: "
          + "; ".join(f"{tid}: {' > '.join(s)}" for tid, s in sorted(seen.items()))
          + (f"; status said: {shown[0].strip()}" if shown else ""))
