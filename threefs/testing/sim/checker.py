"""What must hold in every simulated run, checked from what the run recorded.

The driver reports every commit (`record_commit`), the scenario every acknowledged write (`ack`) and
every read that returned data (`read`). `check` then asserts:
- one content per committed version (replicas never commit different data under one version);
- no acknowledged write is lost: the final version is >= every acknowledged version, and the content
  recorded for an acknowledged version is what the head acknowledged;
- reads are never older than a write acknowledged before the read started (single-chunk
  linearizability in version order), and return exactly the content of the version they report;
- after healing and one final write, all replicas hold identical committed chunks and no pending ones.
"""

from __future__ import annotations


class Checker:
    def __init__(self) -> None:
        self.history: dict[tuple[bytes, int], bytes] = {}  # (chunk, version) -> committed content
        self.acked: list[tuple[bytes, int, float, bytes]] = []  # (chunk, version, ack time, content)
        self.reads: list[tuple[bytes, float, int, bytes]] = []  # (chunk, start time, version, content)
        self.violations: list[str] = []

    def record_commit(self, now: float, cid: bytes, store) -> None:
        """A replica committed a version of `cid` (the driver calls this after every Commit effect)."""
        ver, data = store.read_committed(cid)
        if ver == 0:
            return
        seen = self.history.setdefault((cid, ver), data)
        if seen != data:
            self.violations.append(f"t={now:.3f} chunk {cid[-1]} version {ver} committed with two "
                                   f"contents: {seen!r} and {data!r}")

    def ack(self, cid: bytes, version: int, now: float) -> None:
        """A client got the acknowledgement of a write as `version`."""
        self.acked.append((cid, version, now, self.history.get((cid, version))))

    def read(self, cid: bytes, started: float, version: int, content: bytes) -> None:
        self.reads.append((cid, started, version, content))

    def fail(self, problem: str) -> None:
        self.violations.append(problem)

    def check(self, label: str, nodes: dict, chunks: list[bytes]) -> None:
        """Raise AssertionError naming the run (`label`) and its first problems, if any."""
        problems = list(self.violations)
        for cid in chunks:
            final = max((v for (c, v) in self.history if c == cid), default=0)
            for c, ver, _, content in self.acked:
                if c == cid and (ver > final or content is None):
                    problems.append(f"acknowledged write v{ver} of chunk {cid[-1]} is lost")
            problems += self._check_reads(cid)
            states = {(t, n.store.read_committed(cid), cid in n.store.pending) for t, n in nodes.items()}
            if len({s[1] for s in states}) != 1 or any(s[2] for s in states):
                problems.append(f"replicas of chunk {cid[-1]} differ after healing: {sorted(states)}")
        if problems:
            raise AssertionError(f"{label}: " + "; ".join(problems[:5]))

    def _check_reads(self, cid: bytes) -> list[str]:
        out = []
        acks = sorted((t, v) for c, v, t, _ in self.acked if c == cid)
        for c, started, ver, content in self.reads:
            if c != cid:
                continue
            if ver and self.history.get((cid, ver)) != content:
                out.append(f"read of chunk {cid[-1]} v{ver} returned content never committed as v{ver}")
            newest_acked = max((v for t, v in acks if t < started), default=0)
            if ver < newest_acked:
                out.append(f"stale read of chunk {cid[-1]} at t={started:.3f}: v{ver} < acknowledged "
                           f"v{newest_acked}")
        return out
