"""GraySort as pond runs it: pond nodes and tasks for gensort, the two sort phases and valsort.

    gensort  M tasks: task i writes records [first + i·n, first + (i+1)·n) to input/part-i.dat
    phase 1  M producer tasks (one per input file): read the file in blocks, group each block's records by
             key range (2^k ranges of the top key bits, or sampled split points), append the groups to one
             shuffle file per producer; its output names the byte range of every partition in that file.
             P inline consumers gather range j of every producer (the shuffle goes through the file system)
    phase 2  P sort tasks: read partition j's ranges (one batch read), sort by the 10-byte key, write
             output/part-j.dat (a temporary name, renamed when complete)
    valsort  P tasks: count, checksum, order and duplicates per output file; the driver checks the order
             across partition boundaries and compares count and checksum with the input's

Every task leaves pond's completion marker, so a rerun of a killed job (same job id, time and data root)
skips what finished; a task whose worker died is run again by the scheduler. The data moves through the
threefs client's batch IO as raw 100-byte records (see fileio.py), never Parquet.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa

from threefs.pond.common import PondError
from threefs.pond.execution.task import (ArrowTableDataSet, PartitionConsumerTask, Task)
from threefs.pond.graysort import fileio, records as R
from threefs.pond.logical.dataset import DataSet, PartitionedDataSet
from threefs.pond.logical.node import (DataSourceNode, EvenlyDistributedPartitionNode, PartitionNode,
                                       PythonScriptNode)

MB = 1 << 20
GEN_BLOCK_RECORDS = 1 << 20          # gensort: records generated (and written) per block, ~100 MB
READ_BLOCK_BYTES = 256 * MB          # phase 1 / valsort: bytes read per block
SORT_MEMORY_FACTOR = 2.5             # phase 2 holds a partition ~2.5 times (read buffer, sorted copy, keys)
MANIFEST = "_manifest.json"


# ---------------------------------------------------------------------------------------------------------------
# data sets: byte ranges of raw record files

class RecordFiles(DataSet):
    """Byte ranges (path, offset, length) of raw 100-byte-record files; `checksum` when known."""

    def __init__(self, pieces: Sequence[Tuple[str, int, int]], checksum: Optional[int] = None) -> None:
        pieces = [(str(p), int(o), int(n)) for p, o, n in pieces]
        super().__init__(list(dict.fromkeys(p for p, _, _ in pieces)))
        self.pieces = pieces
        self.checksum = checksum
        self._resolved_paths = list(self.paths)

    @property
    def resolved_paths(self) -> List[str]:
        return self._resolved_paths

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.pieces)

    @property
    def num_rows(self) -> int:
        return self.nbytes // R.RECORD

    def _with_paths(self, paths: List[str]) -> "RecordFiles":
        keep = set(paths)
        return RecordFiles([p for p in self.pieces if p[0] in keep])

    @staticmethod
    def merge(datasets: Sequence["RecordFiles"]) -> "RecordFiles":
        return RecordFiles([p for d in datasets for p in d.pieces])

    def __str__(self) -> str:
        digest = hashlib.sha256(repr(self.pieces).encode()).hexdigest()[:12]
        return f"RecordFiles[{len(self.pieces)} pieces, {self.nbytes} bytes, {digest}]"

    __repr__ = __str__


def _record_files(inputs: Sequence[DataSet]) -> RecordFiles:
    out = []
    for d in inputs:
        if not isinstance(d, RecordFiles):
            raise PondError(f"expected raw record files, got {type(d).__name__}: {d}")
        out.append(d)
    return RecordFiles.merge(out)


def _blocks(pieces: Sequence[Tuple[str, int, int]], block_bytes: int):
    """The pieces cut into groups of at most block_bytes (cut at record boundaries)."""
    block_bytes = max(R.RECORD, block_bytes // R.RECORD * R.RECORD)
    group, size = [], 0
    for path, off, n in pieces:
        while n > 0:
            take = min(n, block_bytes - size)
            group.append((path, off, take))
            size += take
            off += take
            n -= take
            if size == block_bytes:
                yield group
                group, size = [], 0
    if group:
        yield group


# ---------------------------------------------------------------------------------------------------------------
# fault injection (tests, benchmarks): a task kills its own worker once, mid-task

@dataclass(frozen=True)
class Fault:
    """Kill the worker running task `index` of `phase` ("gensort", "partition", "sort") once, half-way through
    its output; `flag` (a local path) records that it happened. With `kill_pid` (the driver's pid) that
    process is killed first: the whole job dies mid-phase, as when its host goes down."""
    phase: str
    index: int
    flag: str
    kill_pid: int = 0

    def maybe_die(self, phase: str, index: int) -> None:
        if phase == self.phase and index == self.index and not os.path.exists(self.flag):
            with open(self.flag, "w") as f:
                f.write(f"{phase} {index} pid {os.getpid()} {time.time()}\n")
            if self.kill_pid:
                os.kill(self.kill_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def _die_if(fault: Optional[Fault], phase: str, index: int) -> None:
    if fault is not None:
        fault.maybe_die(phase, index)


# ---------------------------------------------------------------------------------------------------------------
# gensort

class GenSortTask(Task):
    def __init__(self, runtime_ctx, input_deps, partition_infos, out_dir: str, first: int, counts: List[int],
                 skew: bool, fault: Optional[Fault] = None, cpu_limit=1, memory_limit=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, cpu_limit=cpu_limit, memory_limit=memory_limit)
        self.out_dir, self.first, self.counts, self.skew, self.fault = out_dir, first, counts, skew, fault

    def describe(self) -> str:
        return f"GenSort:{self.out_dir}:{self.first}:{self.counts[self.partition_index]}:{self.skew}"

    def execute(self, input_datasets: List[DataSet]) -> DataSet:
        i = self.partition_index
        n = self.counts[i]
        first = self.first + sum(self.counts[:i])
        path = os.path.join(self.out_dir, f"part-{i:05d}.dat")
        tmp = f"{path}.{self.runtime_ctx.job_id}.{self.attempt}.tmp"
        fileio.remove(tmp)
        fileio.create_empty(tmp)
        total = 0
        for pos in range(0, n, GEN_BLOCK_RECORDS):
            m = min(GEN_BLOCK_RECORDS, n - pos)
            recs = R.gensort(first + pos, m, self.skew)
            total += R.checksum(recs)
            fileio.write_at(tmp, [(pos * R.RECORD, recs)])
            if pos + m >= n // 2:
                _die_if(self.fault, "gensort", i)
        fileio.rename(tmp, path)
        return RecordFiles([(path, 0, n * R.RECORD)], checksum=total)


class GenSortNode(PythonScriptNode):
    def __init__(self, ctx, input_deps, out_dir: str, first: int, counts: List[int], skew: bool,
                 fault: Optional[Fault] = None) -> None:
        super().__init__(ctx, input_deps)
        self.out_dir, self.first, self.counts, self.skew, self.fault = out_dir, first, counts, skew, fault

    def create_task(self, runtime_ctx, input_deps, partition_infos):
        return GenSortTask(runtime_ctx, input_deps, partition_infos, self.out_dir, self.first, self.counts,
                           self.skew, self.fault)


# ---------------------------------------------------------------------------------------------------------------
# phase 1: partition by key range

class RecordPartitionTask(Task):
    """Producer: the records of its input grouped by key range, appended block by block to one shuffle file."""

    def __init__(self, runtime_ctx, input_deps, partition_infos, npartitions: int, splits: Optional[List[int]],
                 block_bytes: int, fault: Optional[Fault] = None, cpu_limit=1, memory_limit=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, output_name="GraySortShuffle",
                         cpu_limit=cpu_limit, memory_limit=memory_limit)
        self.npartitions, self.splits, self.block_bytes, self.fault = npartitions, splits, block_bytes, fault
        self._ranges: List[List[Tuple[int, int]]] = []

    def describe(self) -> str:
        splits = "prefix" if self.splits is None else hashlib.sha256(repr(self.splits).encode()).hexdigest()[:16]
        return f"GraySortPartition:{self.npartitions}:{splits}:{self.block_bytes}"

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        src = _record_files(input_datasets)
        path = os.path.join(output_dir, "shuffle.dat")
        fileio.create_empty(path)
        ranges: List[List[Tuple[int, int]]] = [[] for _ in range(self.npartitions)]
        bits = int(math.log2(self.npartitions))
        splits = np.array(self.splits, np.uint64) if self.splits is not None else None
        pos = 0
        for block in _blocks(src.pieces, self.block_bytes):
            recs = R.as_records(fileio.read_all(block))
            grouped, counts = R.partition(recs, splits, bits)
            del recs
            fileio.write_at(path, [(pos, grouped)])
            start = pos
            for j, c in enumerate(counts.tolist()):
                if c:
                    ranges[j].append((start, c * R.RECORD))
                    start += c * R.RECORD
            pos += grouped.nbytes
            del grouped
            _die_if(self.fault, "partition", self.partition_index)
        self._ranges = ranges

    def output_dataset(self, final_dir: str) -> DataSet:
        path = os.path.join(final_dir, "shuffle.dat")
        return _Shuffle([RecordFiles([(path, off, n) for off, n in rs]) for rs in self._ranges])


class _Shuffle(PartitionedDataSet):
    @property
    def resolved_paths(self) -> List[str]:
        return list(dict.fromkeys(p for d in self.datasets for p in d.resolved_paths))


class RecordConsumerTask(PartitionConsumerTask):
    """Partition j: range j of every producer's shuffle file (names only; runs in the driver)."""

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        j = self.partition_index
        return RecordFiles.merge([ds[j] for ds in input_datasets])


class RecordPartitionNode(PartitionNode):
    max_num_producer_tasks = 1 << 20

    def __init__(self, ctx, input_deps, npartitions: int, splits: Optional[List[int]] = None,
                 block_bytes: int = READ_BLOCK_BYTES, fault: Optional[Fault] = None) -> None:
        if splits is None and npartitions & (npartitions - 1):
            raise PondError(f"partitions by key prefix must be a power of 2, got {npartitions} "
                            "(or give split points: --sample)")
        if splits is not None and len(splits) != npartitions - 1:
            raise PondError(f"{len(splits)} split points make {len(splits) + 1} partitions, not {npartitions}")
        super().__init__(ctx, input_deps, npartitions)
        self.splits, self.block_bytes, self.fault = splits, block_bytes, fault

    def describe(self) -> str:
        how = "top key bits" if self.splits is None else "sampled split points"
        return f"{repr(self)} npartitions={self.npartitions} by key range ({how})"

    def create_producer_task(self, runtime_ctx, input_deps, partition_infos):
        return RecordPartitionTask(runtime_ctx, input_deps, partition_infos, self.npartitions, self.splits,
                                   self.block_bytes, self.fault)

    def create_consumer_task(self, runtime_ctx, input_deps, partition_infos):
        return RecordConsumerTask(runtime_ctx, input_deps, partition_infos)


# ---------------------------------------------------------------------------------------------------------------
# phase 2: sort each partition

class SortTask(Task):
    def __init__(self, runtime_ctx, input_deps, partition_infos, out_dir: str, fault: Optional[Fault] = None,
                 cpu_limit=1, memory_limit=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, cpu_limit=cpu_limit, memory_limit=memory_limit)
        self.out_dir, self.fault = out_dir, fault

    def describe(self) -> str:
        return f"GraySortSort:{self.out_dir}"

    def execute(self, input_datasets: List[DataSet]) -> DataSet:
        j = self.partition_index
        src = _record_files(input_datasets)
        budget = self.effective_memory_limit()
        if src.nbytes * SORT_MEMORY_FACTOR > budget:
            raise PondError(f"partition {j} holds {src.nbytes / 1e9:.2f} GB, more than a sort task's memory "
                            f"budget of {budget / 1e9:.2f} GB allows (x{SORT_MEMORY_FACTOR}); the keys are skewed "
                            "or the partitions too few: use more partitions or sampled split points (--sample)")
        path = os.path.join(self.out_dir, f"part-{j:05d}.dat")
        tmp = f"{path}.{self.runtime_ctx.job_id}.{self.attempt}.tmp"
        fileio.remove(tmp)
        recs = R.as_records(fileio.read_all(src.pieces))
        out = R.sort_records(recs)
        del recs
        half = (len(out) // 2) * R.RECORD
        flat = out.reshape(-1)
        fileio.create_empty(tmp)
        fileio.write_at(tmp, [(0, flat[:half])])
        _die_if(self.fault, "sort", j)
        fileio.write_at(tmp, [(half, flat[half:])])
        fileio.rename(tmp, path)
        return RecordFiles([(path, 0, out.nbytes)])


class SortNode(PythonScriptNode):
    def __init__(self, ctx, input_deps, out_dir: str, fault: Optional[Fault] = None, memory_limit=None) -> None:
        super().__init__(ctx, input_deps, memory_limit=memory_limit)
        self.out_dir, self.fault = out_dir, fault

    def create_task(self, runtime_ctx, input_deps, partition_infos):
        return SortTask(runtime_ctx, input_deps, partition_infos, self.out_dir, self.fault,
                        memory_limit=self.memory_limit)


# ---------------------------------------------------------------------------------------------------------------
# valsort

VALSORT_SCHEMA = pa.schema([("partition", pa.int64()), ("path", pa.string()), ("records", pa.int64()),
                            ("checksum", pa.string()), ("duplicates", pa.int64()), ("first_unordered", pa.int64()),
                            ("first_key", pa.binary()), ("last_key", pa.binary())])


class ValsortTask(Task):
    def __init__(self, runtime_ctx, input_deps, partition_infos, block_bytes: int = READ_BLOCK_BYTES) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos)
        self.block_bytes = block_bytes

    def describe(self) -> str:
        return f"Valsort:{self.block_bytes}"

    def execute(self, input_datasets: List[DataSet]) -> DataSet:
        src = _record_files(input_datasets)
        count, total, dups, bad = 0, 0, 0, -1
        first_key, last_key = b"", b""
        for block in _blocks(src.pieces, self.block_bytes):
            recs = R.as_records(fileio.read_all(block))
            if not len(recs):
                continue
            k0 = R.key_bytes(recs, 0)
            if count and k0 < last_key and bad < 0:
                bad = count
            if count and k0 == last_key:
                dups += 1
            b, d = R.check_order(recs)
            if b >= 0 and bad < 0:
                bad = count + b
            dups += d
            total += R.checksum(recs)
            if not count:
                first_key = k0
            last_key = R.key_bytes(recs, len(recs) - 1)
            count += len(recs)
        row = {"partition": [self.partition_index], "path": [src.paths[0] if src.paths else ""],
               "records": [count], "checksum": [f"{total:x}"], "duplicates": [dups], "first_unordered": [bad],
               "first_key": [first_key], "last_key": [last_key]}
        return ArrowTableDataSet(pa.table(row, schema=VALSORT_SCHEMA))


class ValsortNode(PythonScriptNode):
    def create_task(self, runtime_ctx, input_deps, partition_infos):
        return ValsortTask(runtime_ctx, input_deps, partition_infos)


@dataclass
class Validation:
    ok: bool
    records: int
    checksum: int
    duplicates: int
    partitions: int
    partition_records: List[int]
    expected_records: Optional[int] = None
    expected_checksum: Optional[int] = None
    first_unordered: Optional[int] = None        # global record position (0-based) of the first unordered record
    first_unordered_where: str = ""
    problems: List[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"Records: {self.records}" + (f" (input {self.expected_records})" if self.expected_records is not None else ""),
                 f"Checksum: {self.checksum:x}" + (f" (input {self.expected_checksum:x})" if self.expected_checksum is not None else ""),
                 f"Duplicate keys: {self.duplicates}",
                 f"Partitions: {self.partitions} (records min {min(self.partition_records, default=0)}, "
                 f"max {max(self.partition_records, default=0)})"]
        if self.first_unordered is not None:
            lines.append(f"First unordered record: {self.first_unordered} ({self.first_unordered_where})")
        lines += [f"ERROR: {p}" for p in self.problems]
        lines.append("SUCCESS - all records are in order" if self.ok else "FAILURE")
        return "\n".join(lines)


def combine_validation(rows: Sequence[dict], expected_records: Optional[int] = None,
                       expected_checksum: Optional[int] = None) -> Validation:
    """The global result from the per-partition rows (in partition order): order inside each partition and
    across the boundaries, the total count and checksum against the input's."""
    rows = sorted(rows, key=lambda r: r["partition"])
    records = sum(r["records"] for r in rows)
    total = sum(int(r["checksum"], 16) for r in rows)
    dups = sum(r["duplicates"] for r in rows)
    first, where = None, ""
    pos, prev_last = 0, None
    for r in rows:
        if r["records"] == 0:
            continue
        if prev_last is not None and r["first_key"] < prev_last and first is None:
            first, where = pos, (f"partition {r['partition']} ({r['path']}) record 0: its first key "
                                 f"{r['first_key'].hex()} is below the last key {prev_last.hex()} of the partition before")
        if prev_last is not None and r["first_key"] == prev_last:
            dups += 1
        if r["first_unordered"] >= 0 and first is None:
            first = pos + r["first_unordered"]
            where = f"partition {r['partition']} ({r['path']}) record {r['first_unordered']}"
        prev_last = r["last_key"]
        pos += r["records"]
    problems = []
    if first is not None:
        problems.append(f"records out of order, the first at position {first}: {where}")
    if expected_records is not None and records != expected_records:
        problems.append(f"{records} records in the output, {expected_records} in the input")
    if expected_checksum is not None and total != expected_checksum:
        problems.append(f"checksum {total:x} of the output differs from the input's {expected_checksum:x}")
    return Validation(ok=not problems, records=records, checksum=total, duplicates=dups, partitions=len(rows),
                      partition_records=[r["records"] for r in rows], expected_records=expected_records,
                      expected_checksum=expected_checksum, first_unordered=first, first_unordered_where=where,
                      problems=problems)


# ---------------------------------------------------------------------------------------------------------------
# plans

def _fan_out(ctx, n: int):
    """A node of n partitions (one row each) to hang n independent tasks on."""
    src = DataSourceNode(ctx, ArrowTableDataSet(pa.table({"part": list(range(n))})))
    return EvenlyDistributedPartitionNode(ctx, (src,), n, partition_by_rows=True) if n > 1 else src


def files_node(ctx, files: RecordFiles):
    """One partition per file."""
    src = DataSourceNode(ctx, files)
    n = len(files.paths)
    return EvenlyDistributedPartitionNode(ctx, (src,), n) if n > 1 else src


@dataclass
class Manifest:
    """What gensort wrote (input/_manifest.json): enough for graysort and valsort to check against."""
    format: str
    records: int
    first_record: int
    skew: bool
    checksum: str
    files: List[str]
    records_per_file: List[int]

    @property
    def checksum_int(self) -> int:
        return int(self.checksum, 16)

    @property
    def nbytes(self) -> int:
        return self.records * R.RECORD

    def record_files(self) -> RecordFiles:
        return RecordFiles([(f, 0, n * R.RECORD) for f, n in zip(self.files, self.records_per_file)],
                           checksum=self.checksum_int)

    def dump(self, path: str) -> None:
        fileio.write_text(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str) -> "Manifest":
        try:
            data = json.loads(fileio.read_text(path))
        except FileNotFoundError:
            raise PondError(f"{path} not found: is this a directory written by `threefs pond gensort`?") from None
        return cls(**data)


def input_files(input_dir: str) -> Tuple[RecordFiles, Optional[Manifest]]:
    """The input records of a directory: the manifest's files when gensort wrote it, else its *.dat files."""
    mpath = os.path.join(input_dir, MANIFEST)
    if fileio.exists(mpath):
        m = Manifest.load(mpath)
        return m.record_files(), m
    if not fileio.exists(input_dir):
        raise PondError(f"input directory {input_dir} does not exist")
    names = [n for n in fileio.listdir(input_dir) if n.endswith(".dat")]
    if not names:
        raise PondError(f"no *.dat record files in {input_dir}")
    pieces = []
    for n in names:
        p = os.path.join(input_dir, n)
        size = fileio.size(p)
        if size % R.RECORD:
            raise PondError(f"{p} holds {size} bytes, not a whole number of {R.RECORD}-byte records")
        pieces.append((p, 0, size))
    return RecordFiles(pieces), None


def sample_splits(files: RecordFiles, npartitions: int, per_partition: int = 64) -> List[int]:
    """npartitions-1 split points (on the 8-byte key prefix) from keys read at evenly spaced records of the
    inputs: partitions of about equal size even when the keys are skewed."""
    total = files.num_rows
    want = min(total, max(npartitions * per_partition, npartitions))
    if want == 0:
        return [0] * (npartitions - 1)
    pieces, pos = [], 0
    targets = np.linspace(0, total - 1, want).astype(np.int64)
    starts = []
    for path, off, n in files.pieces:
        starts.append((pos, path, off))
        pos += n // R.RECORD
    si = 0
    for t in targets.tolist():
        while si + 1 < len(starts) and starts[si + 1][0] <= t:
            si += 1
        base, path, off = starts[si]
        pieces.append((path, off + (t - base) * R.RECORD, 8))
    buf = fileio.read_all(pieces)
    k8 = np.sort(buf.view(">u8").astype(np.uint64))
    idx = (np.arange(1, npartitions) * len(k8)) // npartitions
    return [int(v) for v in k8[idx]]
