"""The workload of the soak (threefs/testing/soak.py), run inside the client host's network namespace:

    python -m threefs.testing.soak_worker CLIENT_CONF STOP_FILE SEED OUT_DIR [--checkpoint]

Threads, each with its own seeded generator, run until STOP_FILE exists:
- files:     whole-file writes and overwrites of /soak/files/fNN (file objects), and reads that check what
             comes back against the versions the thread wrote;
- batch:     batch_write of 64 KiB blocks into /soak/batch/bNN at random offsets, batch_read back;
- namespace: creates, renames and unlinks in /soak/ns;
- ckpt:      (--checkpoint) CheckpointManager save and load of a small state dict.

Every acknowledged operation is appended to OUT_DIR/<thread>.log as one JSON line, so the checker sees
exactly what was acknowledged, even if this process dies. A read whose bytes match no version the
thread wrote is a *corrupt read* ("CORRUPT" line); the end report (OUT_DIR/report.json) counts ops by
kind, failures by error code, corrupt reads and the longest stall (the longest single operation,
retries included). `verify()` (run by threefs/testing/soak_ctl.py) replays the logs against the cluster.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

from threefs.client.client import Client
from threefs.common import crc32c
from threefs.common.status import ThreeFSError

FILES = 16  # files per files-thread
BATCH_FILES = 4
BLOCK = 64 * 1024
BLOCKS_PER_FILE = 64
NS_NAMES = 64


FAILURE_MESSAGES_KEPT = 20  # per thread


class Recorder:
    def __init__(self, out: Path, name: str):
        self.name = name
        self._f = open(out / f"{name}.log", "a", buffering=1)
        self.ops: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.failure_messages: list[str] = []  # the first few, to say why operations failed
        self.corrupt: list[str] = []
        self.longest_stall_s = 0.0
        self.bytes_acked = 0

    def timed(self, kind: str, fn):
        """Run fn(); on success count it and return (True, result); on a threefs error (False, error)."""
        t0 = time.monotonic()
        try:
            result = fn()
        except ThreeFSError as e:
            key = f"{kind}_absent" if isinstance(e, FileNotFoundError) else None  # an answer, not a failure
            if key:
                self.ops[key] = self.ops.get(key, 0) + 1
            else:
                self.failures[f"{kind}:{e.code.name}"] = self.failures.get(f"{kind}:{e.code.name}", 0) + 1
                if len(self.failure_messages) < FAILURE_MESSAGES_KEPT:
                    self.failure_messages.append(f"{time.strftime('%H:%M:%S')} {kind}: {e}"[:600])
            return False, e
        finally:
            self.longest_stall_s = max(self.longest_stall_s, time.monotonic() - t0)
        self.ops[kind] = self.ops.get(kind, 0) + 1
        return True, result

    def ack(self, **record) -> None:
        self._f.write(json.dumps(record) + "\n")

    def corrupt_read(self, what: str) -> None:
        self.corrupt.append(what)
        self._f.write(json.dumps({"op": "CORRUPT", "what": what}) + "\n")


def files_thread(fs: Client, rec: Recorder, rng: random.Random, stop: str) -> None:
    base = "/soak/files"
    known: dict[str, set[int]] = {}  # path -> crcs of versions it may hold (acked, or written but unacked)
    while not os.path.exists(stop):
        path = f"{base}/f{rng.randrange(FILES):02d}"
        if rng.random() < 0.6:
            data = rng.randbytes(rng.randrange(1, 3 << 20))
            crc = crc32c.crc32c(data)
            known.setdefault(path, set()).add(crc)  # may land even if the call fails

            def write():
                with fs.open(path, "wb") as f:
                    f.write(data)
            ok, _ = rec.timed("file_write", write)
            if ok:
                known[path] = {crc}  # acknowledged: from now on this is the content
                rec.bytes_acked += len(data)
                rec.ack(op="file", path=path, crc=crc, length=len(data))
            else:
                known[path].add(-1)  # a failed whole-file write may leave any mix: stop checking it
                rec.ack(op="fail", path=path)
        elif path in known:
            ok, data = rec.timed("file_read", lambda: fs.read_bytes(path))
            if ok and -1 not in known[path] and crc32c.crc32c(data) not in known[path]:
                rec.corrupt_read(f"{path}: {len(data)} B, crc {crc32c.crc32c(data)} not among {known[path]}")


def batch_thread(fs: Client, rec: Recorder, rng: random.Random, stop: str) -> None:
    base = "/soak/batch"
    blocks: dict[tuple[str, int], set[int]] = {}  # (path, block) -> crcs it may hold
    while not os.path.exists(stop):
        path = f"{base}/b{rng.randrange(BATCH_FILES)}"
        picks = rng.sample(range(BLOCKS_PER_FILE), 8)
        if rng.random() < 0.5 or not any((path, b) in blocks for b in picks):
            bufs = [rng.randbytes(BLOCK) for _ in picks]
            for b, buf in zip(picks, bufs):
                blocks.setdefault((path, b), set()).add(crc32c.crc32c(buf))
            ok, res = rec.timed("batch_write", lambda: fs.batch_write(
                [(path, b * BLOCK, buf) for b, buf in zip(picks, bufs)], create=True))
            if ok:
                for b, buf in zip(picks, bufs):
                    blocks[(path, b)] = {crc32c.crc32c(buf)}
                rec.bytes_acked += BLOCK * len(bufs)
                rec.ack(op="blocks", path=path, blocks={b: crc32c.crc32c(buf) for b, buf in zip(picks, bufs)})
            else:
                rec.ack(op="fail_blocks", path=path, blocks=picks)
        else:
            have = [b for b in picks if (path, b) in blocks]
            bufs = [bytearray(BLOCK) for _ in have]
            ok, _ = rec.timed("batch_read", lambda: fs.batch_read([(path, b * BLOCK, buf)
                                                                   for b, buf in zip(have, bufs)]))
            if ok:
                for b, buf in zip(have, bufs):
                    if crc32c.crc32c(buf) not in blocks[(path, b)]:
                        rec.corrupt_read(f"{path} block {b}: crc {crc32c.crc32c(buf)} not among "
                                         f"{blocks[(path, b)]}")


def namespace_thread(fs: Client, rec: Recorder, rng: random.Random, stop: str) -> None:
    base = "/soak/ns"
    while not os.path.exists(stop):
        a, b = f"{base}/n{rng.randrange(NS_NAMES):02d}", f"{base}/n{rng.randrange(NS_NAMES):02d}"
        r = rng.random()
        if r < 0.4:
            ok, _ = rec.timed("create", lambda: fs.write_bytes(a, a.encode()))
            rec.ack(op="create" if ok else "fail", path=a)
        elif r < 0.7:
            ok, _ = rec.timed("rename", lambda: fs.rename(a, b))
            if ok:
                rec.ack(op="rename", src=a, dst=b)
            elif isinstance(_, FileNotFoundError):
                rec.ack(op="absent", path=a)  # ENOENT is an answer too: a was not there
            else:
                rec.ack(op="fail", path=a, also=b)
        else:
            ok, _ = rec.timed("unlink", lambda: fs.remove(a))
            if ok:
                rec.ack(op="unlink", path=a)
            elif isinstance(_, FileNotFoundError):
                rec.ack(op="absent", path=a)
            else:
                rec.ack(op="fail", path=a)


def checkpoint_thread(fs: Client, rec: Recorder, rng: random.Random, stop: str) -> None:
    import torch

    from threefs.checkpoint import CheckpointManager

    manager = CheckpointManager(fs, "/soak/ckpt", keep_last=2)
    step = 0
    while not os.path.exists(stop):
        step += 1
        g = torch.Generator().manual_seed(step)
        state = {"w": torch.randn(256, 1024, generator=g), "step": step}
        ok, _ = rec.timed("ckpt_save", lambda: manager.save(state, step))
        if ok:
            rec.ack(op="ckpt", step=step)
            ok, loaded = rec.timed("ckpt_load", lambda: manager.load(step=step))
            if ok and not (torch.equal(loaded["w"], state["w"]) and loaded["step"] == step):
                rec.corrupt_read(f"checkpoint step {step} loaded different tensors")
        time.sleep(rng.uniform(0.5, 2.0))


def verify(fs: Client, out_dir: Path) -> dict:
    """Replay the acknowledgement logs and check the cluster holds every acknowledged result."""
    expect_files: dict[str, tuple[int, int] | None] = {}  # path -> (crc, length); None = uncertain
    expect_blocks: dict[tuple[str, int], int | None] = {}
    expect_names: dict[str, bool | None] = {}  # path -> present?
    ckpt_steps: list[int] = []
    for log in sorted(out_dir.glob("*.log")):
        for line in log.read_text().splitlines():
            r = json.loads(line)
            op = r["op"]
            if op == "file":
                expect_files[r["path"]] = (r["crc"], r["length"])
            elif op == "fail" and r["path"].startswith("/soak/files/"):
                expect_files[r["path"]] = None
            elif op == "blocks":
                for b, crc in r["blocks"].items():
                    expect_blocks[(r["path"], int(b))] = crc
            elif op == "fail_blocks":
                for b in r["blocks"]:
                    expect_blocks[(r["path"], int(b))] = None
            elif op == "create":
                expect_names[r["path"]] = True
            elif op == "rename":
                expect_names[r["src"]], expect_names[r["dst"]] = False, True
            elif op in ("unlink", "absent"):
                expect_names[r["path"]] = False
            elif op == "fail" and r["path"].startswith("/soak/ns/"):
                expect_names[r["path"]] = None
                if "also" in r:
                    expect_names[r["also"]] = None
            elif op == "ckpt":
                ckpt_steps.append(r["step"])
    lost, lost_bytes, checked = [], 0, 0
    for path, want in expect_files.items():
        if want is None:
            continue
        checked += 1
        try:
            data = fs.read_bytes(path)
        except ThreeFSError as e:
            data = f"<{e.code.name}>".encode()
        if crc32c.crc32c(data) != want[0] or len(data) != want[1]:
            lost.append(f"{path}: want crc {want[0]} ({want[1]} B), have {crc32c.crc32c(data)} ({len(data)} B)")
            lost_bytes += want[1]
    for (path, b), want in expect_blocks.items():
        if want is None:
            continue
        checked += 1
        buf = bytearray(BLOCK)
        try:
            fs.batch_read([(path, b * BLOCK, buf)])
        except ThreeFSError as e:
            buf = bytearray(f"<{e.code.name}>".encode())
        if crc32c.crc32c(buf) != want:
            lost.append(f"{path} block {b}: want crc {want}, have {crc32c.crc32c(buf)}")
            lost_bytes += BLOCK
    wrong_names = []
    for path, present in expect_names.items():
        if present is None:
            continue
        checked += 1
        if fs.exists(path) != present:
            wrong_names.append(f"{path}: should be {'present' if present else 'absent'}")
    ckpt_problems = []
    if ckpt_steps:
        from threefs.checkpoint import CheckpointManager

        manager = CheckpointManager(fs, "/soak/ckpt", keep_last=2)
        try:
            manager.load(step=ckpt_steps[-1])
        except ThreeFSError as e:
            ckpt_problems.append(f"last acknowledged checkpoint step {ckpt_steps[-1]} does not load: {e}")
    return {"checked": checked, "lost": lost[:20], "lost_count": len(lost), "acked_bytes_lost": lost_bytes,
            "namespace_wrong": wrong_names[:20], "namespace_wrong_count": len(wrong_names),
            "checkpoint_problems": ckpt_problems, "checkpoints_acked": len(ckpt_steps)}


def main(argv: list[str]) -> int:
    conf, stop, seed, out = argv[:4]
    checkpoint = "--checkpoint" in argv
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    fs = Client.connect(conf)
    for d in ("/soak", "/soak/files", "/soak/batch", "/soak/ns"):
        fs.mkdir(d, exist_ok=True)
    kinds = [("files", files_thread), ("batch", batch_thread), ("namespace", namespace_thread)]
    if checkpoint:
        kinds.append(("ckpt", checkpoint_thread))
    recorders, threads = [], []
    for i, (name, fn) in enumerate(kinds):
        rec = Recorder(out_dir, name)
        recorders.append(rec)
        rng = random.Random(int(seed) * 1000 + i)
        t = threading.Thread(target=_guarded, args=(fn, fs, rec, rng, stop), name=name, daemon=True)
        threads.append(t)
        t.start()
    for t in threads:
        t.join()
    report = {"ops": {}, "failures": {}, "failure_messages": [], "corrupt_reads": [], "longest_stall_s": 0.0,
              "bytes_acked": 0}
    for rec in recorders:
        report["failure_messages"] += rec.failure_messages
        for k, v in rec.ops.items():
            report["ops"][k] = report["ops"].get(k, 0) + v
        for k, v in rec.failures.items():
            report["failures"][k] = report["failures"].get(k, 0) + v
        report["corrupt_reads"] += rec.corrupt
        report["longest_stall_s"] = max(report["longest_stall_s"], rec.longest_stall_s)
        report["bytes_acked"] += rec.bytes_acked
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    fs.close()
    return 0


def _guarded(fn, fs, rec, rng, stop) -> None:
    try:
        fn(fs, rec, rng, stop)
    except BaseException as e:  # a bug in the workload itself: recorded, never silent
        rec.failures[f"crash:{type(e).__name__}"] = 1
        rec.ack(op="CRASH", error=repr(e))
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
