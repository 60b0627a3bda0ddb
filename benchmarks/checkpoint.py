"""Checkpoint save/load side by side in one run: threefs CheckpointManager (and DCP on threefs)
against torch.save/torch.load, safetensors save_file/load_file and DCP's FileSystemWriter/Reader on
local disk.

    .venv/bin/python benchmarks/checkpoint.py [--gib 2 4] [--replicas 3] [--storage 3] [--rounds 1]
        [--engines v1,v2] [--direct-reads 1,0] [--methods safetensors,CheckpointManager] [--profile DIR]

--engines runs the threefs part once per chunk engine (a fresh cluster each; the local rows run in each);
--direct-reads likewise once per setting of the storage services' O_DIRECT reads of whole cold chunks;
--methods keeps the methods whose name contains one of the words; --profile records py-spy (raw folded
stacks) of every storage process and of this process during the first cold CheckpointManager load
(non-blocking sampling: py-spy's default pauses the process for each sample, which inflated the figures);
CPU seconds per GB per process for that load are printed with or without it.

State dicts are transformer-shaped (bf16 embeddings, per layer q/k/v/o hidden x hidden, gate/up/down
hidden x ffn, two norms) scaled to the requested size. Every method saves the same dict and loads it
back (checked equal once; a load is timed until one byte of every page of every tensor has been
read, so loaders that map the file pay for reading it too); seconds and GB/s (10^9 B/s) are printed per method, and the ratios the
issue names: threefs load / safetensors load (goal >= 1.0), threefs save / torch.save (goal >= 2.0).
Loads are timed twice: warm (local files and threefs chunk files in the page cache, as they are
right after the save) and cold (both evicted with posix_fadvise first, so both read the disk). Both run in
this process, so a cold load gets back memory the warm load before it freed (malloc keeps it; no new pages
to fault in and zero). With --fresh-process, safetensors' and CheckpointManager's cold loads are also
timed in a new process each (as a job restarting from its checkpoint loads it: every destination page is
new memory), timed from the load call (after imports and connecting) until every page was touched.
Local writes are not fsynced, nor are threefs's (storage fsync=false, its default). With R replicas threefs writes R copies on this one disk.
The machine is shared and noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from threefs.checkpoint import CheckpointManager  # noqa: E402
from benchmarks.common import local_cluster  # noqa: E402
from threefs.client.client import Client  # noqa: E402
from threefs.testing.page_cache import drop_cache  # noqa: E402  (the storage services' chunk files, or the local file)

GiB = 1 << 30
HIDDEN, FFN, VOCAB = 2048, 5504, 32000


def transformer_state(nbytes: int, seed: int = 0) -> dict:
    """A bf16 state dict of about nbytes, shaped like a transformer's."""
    g = torch.Generator().manual_seed(seed)
    per_layer = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN) * 2
    embed = VOCAB * HIDDEN * 2
    layers = max(1, (nbytes - 2 * embed) // per_layer)
    sd = {"tok_embeddings.weight": _rand((VOCAB, HIDDEN), g)}
    for i in range(layers):
        p = f"layers.{i}."
        for name in ("attention.wq", "attention.wk", "attention.wv", "attention.wo"):
            sd[p + name + ".weight"] = _rand((HIDDEN, HIDDEN), g)
        sd[p + "feed_forward.w1.weight"] = _rand((FFN, HIDDEN), g)
        sd[p + "feed_forward.w3.weight"] = _rand((FFN, HIDDEN), g)
        sd[p + "feed_forward.w2.weight"] = _rand((HIDDEN, FFN), g)
        sd[p + "attention_norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        sd[p + "ffn_norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    sd["norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    sd["output.weight"] = _rand((VOCAB, HIDDEN), g)
    return sd


def _rand(shape, g):
    # random bits are slow to make for GiBs; a random row repeated is as good for IO
    row = torch.randint(-2**15, 2**15, (shape[-1],), dtype=torch.int16, generator=g).view(torch.bfloat16)
    return row.expand(shape).clone()


def state_bytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def timed(fn):
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def touch(sd: dict) -> dict:
    """Read one element per 4 KiB page of every tensor: a loader that maps the file (safetensors
    load_file) has only read the pages it was asked for, so every load is timed up to this point."""
    for t in sd.values():
        flat = t.reshape(-1)
        if flat.numel():
            flat[::2048].view(torch.int16).sum()
    return sd


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def methods(fs: Client, local: str, root: str, sd: dict, mnt: str | None):
    """(name, save(), load() -> dict) of every method."""
    import safetensors.torch as st
    import torch.distributed.checkpoint as dcp

    from threefs.checkpoint.dcp import ThreeFSStorageReader, ThreeFSStorageWriter

    mgr = CheckpointManager(fs, f"{root}/mgr", keep_last=1)
    step = iter(range(1_000_000))
    state = {}

    def mgr_save():
        state["step"] = next(step)
        mgr.save(sd, step=state["step"])

    def dcp_load(reader):
        dest = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(dest, storage_reader=reader, no_dist=True)
        return dest

    return [
        ("torch.save / torch.load (local disk)",
         lambda: torch.save(sd, f"{local}/model.pt"),
         lambda: torch.load(f"{local}/model.pt", weights_only=True)),
        ("safetensors save_file / load_file (local disk)",
         lambda: st.save_file(sd, f"{local}/model.safetensors"),
         lambda: st.load_file(f"{local}/model.safetensors")),
        ("DCP FileSystemWriter/Reader (local disk)",
         lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{local}/dcp"), no_dist=True),
         lambda: dcp_load(dcp.FileSystemReader(f"{local}/dcp"))),
        ("threefs CheckpointManager",
         mgr_save,
         lambda: mgr.load(state["step"])),
        ("threefs DCP StorageWriter/Reader",
         lambda: dcp.save(sd, storage_writer=ThreeFSStorageWriter(f"{root}/dcp", fs), no_dist=True),
         lambda: dcp_load(ThreeFSStorageReader(f"{root}/dcp", fs))),
    ] + ([("torch.save / torch.load on the threefs FUSE mount",
           lambda: torch.save(sd, f"{mnt}{root}/model.pt"),
           lambda: torch.load(f"{mnt}{root}/model.pt", weights_only=True))] if mnt else []), mgr, state


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Profile:
    """CPU seconds (and, with a directory, py-spy raw stacks) of given processes over one timed step."""

    def __init__(self, pids: dict[str, int], directory: str | None):
        self.pids, self.directory, self.spies = pids, directory, []

    def __enter__(self):
        import subprocess

        self.cpu0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        if self.directory:
            os.makedirs(self.directory, exist_ok=True)
            spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
            for name, pid in self.pids.items():
                self.spies.append(subprocess.Popen(
                    [spy, "record", "--nonblocking", "-r", "200", "-p", str(pid), "-f", "raw", "-o",
                     os.path.join(self.directory, f"{name}.txt")] + (["--threads"] if name == "loader" else []),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)  # py-spy attaches
        return self

    def __exit__(self, *exc):
        self.cpu = {n: cpu_seconds(p) - self.cpu0[n] for n, p in self.pids.items()}
        for spy in self.spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its file
        for spy in self.spies:
            spy.wait(timeout=60)


def child_load(kind: str, where: str, step: int, config: str) -> None:
    """--child-load: one cold load in this new process; prints its seconds (load call to last page)."""
    if kind == "safetensors":
        import safetensors.torch as st

        t, _ = timed(lambda: touch(st.load_file(where)))
    else:
        with Client.connect(config) as fs:
            mgr = CheckpointManager(fs, where, keep_last=1)
            t, _ = timed(lambda: touch(mgr.load(step)))
            mgr.close()
    print(f"CHILD_SECONDS {t:.6f}")


def fresh_process_cold(kind: str, where: str, step: int, config: str, evict: str) -> float:
    import subprocess

    drop_cache(evict)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-load", kind, where, str(step), config],
                         capture_output=True, text=True, check=True).stdout
    return float(next(line.split()[1] for line in out.splitlines() if line.startswith("CHILD_SECONDS")))


def run_size(fs: Client, tmp: str, cluster_dir: str, gib: float, rounds: int, mnt: str | None,
             words: list[str] | None = None, profile: str | None = None, pids: dict | None = None,
             fresh: bool = False, config: str = "") -> dict:
    sd = transformer_state(int(gib * GiB))
    nbytes = state_bytes(sd)
    local = os.path.join(tmp, f"local-{gib}")
    os.makedirs(local, exist_ok=True)
    root = f"/bench-ckpt-{gib}"
    fs.mkdir(root, exist_ok=True)
    table, mgr, state = methods(fs, local, root, sd, mnt)
    if words:
        table = [m for m in table if any(w in m[0] for w in words)]
    best: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, save, load in table:
            ts, _ = timed(save)
            tl, out = timed(lambda: touch(load()))  # warm: the files are in the page cache
            if r == 0 and not same(sd, out):
                raise SystemExit(f"{name}: loaded state differs from the saved one")
            del out
            drop_cache(cluster_dir if name.startswith("threefs") else local)
            if r == 0 and name == "threefs CheckpointManager" and pids:
                gc.collect()  # outside the CPU window (timed() collects again, with nothing left to do)
                with Profile({**pids, "loader": os.getpid()}, profile) as prof:
                    tc, out = timed(lambda: touch(load()))  # cold: read from the disk
                print("cold CheckpointManager load, CPU s per GB: " + ", ".join(
                    f"{n} {c / (nbytes / 1e9):.2f}" for n, c in sorted(prof.cpu.items()))
                    + (f" (py-spy stacks in {profile})" if profile else ""))
            else:
                tc, out = timed(lambda: touch(load()))  # cold: read from the disk
            del out
            prev = best.get(name, [float("inf")] * 3)
            best[name] = [min(prev[0], ts), min(prev[1], tl), min(prev[2], tc)]
    fresh_best: dict[str, float] = {}
    if fresh and "threefs CheckpointManager" in best and "safetensors save_file / load_file (local disk)" in best:
        cases = [("safetensors", f"{local}/model.safetensors", local),
                 ("threefs CheckpointManager", f"{root}/mgr", cluster_dir)]
        for r in range(rounds):
            for name, where, evict in (cases if r % 2 == 0 else cases[::-1]):
                t = fresh_process_cold(name, where, state["step"], config, evict)
                fresh_best[name] = min(fresh_best.get(name, float("inf")), t)
    # async save: how long the training loop is blocked (the snapshot), and the whole save
    t_block, fut = timed(lambda: mgr.async_save(sd, step=10_000_000))
    t_all, _ = timed(fut.result)
    mgr.close()
    print(f"\n== {gib} GiB state dict: {len(sd)} tensors, {nbytes / 1e9:.2f} GB (best of {rounds})")
    print(f"{'method':<48} {'save s':>7} {'GB/s':>6} {'warm load s':>11} {'GB/s':>6} {'cold load s':>11} {'GB/s':>6}")
    for name, (ts, tl, tc) in best.items():
        print(f"{name:<48} {ts:>7.2f} {nbytes / ts / 1e9:>6.2f} {tl:>11.2f} {nbytes / tl / 1e9:>6.2f} "
              f"{tc:>11.2f} {nbytes / tc / 1e9:>6.2f}")
    print(f"threefs async_save: training blocked {t_block:.2f} s (snapshot), save done "
          f"{t_block + t_all:.2f} s after the call")
    m, s, t = (best.get("threefs CheckpointManager"), best.get("safetensors save_file / load_file (local disk)"),
               best.get("torch.save / torch.load (local disk)"))
    if m and s:
        print(f"ratio threefs load / safetensors load, warm: {s[1] / m[1]:.2f}x, cold: {s[2] / m[2]:.2f}x "
              "(goal >= 1.0; warm safetensors maps the page cache and copies nothing)")
    if fresh_best:
        a, b = fresh_best["safetensors"], fresh_best["threefs CheckpointManager"]
        print(f"cold load in a fresh process (best of {rounds}): safetensors {a:.2f} s = {nbytes / a / 1e9:.2f} GB/s, "
              f"threefs CheckpointManager {b:.2f} s = {nbytes / b / 1e9:.2f} GB/s; ratio {a / b:.2f}x (goal >= 1.0)")
    if m and t:
        print(f"ratio threefs save / torch.save:      {t[0] / m[0]:.2f}x (goal >= 2.0)")
        print(f"ratio threefs async_save blocking / torch.save: {t[0] / t_block:.2f}x faster")
    shutil.rmtree(local, ignore_errors=True)
    fs.remove_tree(root)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[2, 4])
    ap.add_argument("--storage", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-fuse", action="store_true", help="skip torch.save/load through the FUSE mount")
    ap.add_argument("--engines", default="", help="chunk engines to run the threefs part on, e.g. v1,v2 "
                    "(default: the default engine)")
    ap.add_argument("--direct-reads", default="", help="run the threefs part once per value, e.g. 1,0: storage "
                    "reads whole cold chunks with O_DIRECT (1, the default) or buffered (0); THREEFS_DIRECT_READS")
    ap.add_argument("--methods", default="", help="comma-separated words: keep methods whose name has one")
    ap.add_argument("--profile", default=None, help="directory for py-spy stacks of the cold CheckpointManager load")
    ap.add_argument("--fresh-process", action="store_true",
                    help="also time safetensors' and CheckpointManager's cold loads in a new process each")
    ap.add_argument("--child-load", nargs=4, metavar=("KIND", "WHERE", "STEP", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_load:
        kind, where, step, config = args.child_load
        return child_load(kind, where, int(step), config)
    words = [w for w in args.methods.split(",") if w] or None
    runs = [(e, r) for e in args.engines.split(",") for r in args.direct_reads.split(",")]
    for engine, direct in runs:
        if engine:
            os.environ["THREEFS_CHUNK_ENGINE"] = engine  # the storage processes inherit it (new targets)
        if direct:
            os.environ["THREEFS_DIRECT_READS"] = direct
        tmp = tempfile.mkdtemp(prefix="threefs-bench-ckpt-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
        try:
            with local_cluster(tmp, args.storage, args.replicas, fuse=not args.no_fuse) as (cluster, mnt):
                print(f"\n### chunk engine {engine or 'default'}"
                      + (f", direct reads {'on' if direct != '0' else 'off'}" if direct else "")
                      + f": cluster: {args.storage} storage services, "
                      f"R={args.replicas}; torch {torch.__version__}, {os.cpu_count()} CPUs; load average "
                      f"{os.getloadavg()[0]:.1f}")
                pids = {n: p for n, p in cluster.running().items() if n.startswith("storage")}
                with Client.connect(str(cluster.client_config_path)) as fs:
                    for gib in args.gib:
                        prof = (os.path.join(args.profile, f"{engine or 'default'}{direct and '-direct' + direct}-{gib}")
                                if args.profile else None)
                        run_size(fs, tmp, str(cluster.dir), gib, args.rounds, mnt, words, prof, pids,
                                 args.fresh_process, str(cluster.client_config_path))
                print(f"load average after: {os.getloadavg()[0]:.1f}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
