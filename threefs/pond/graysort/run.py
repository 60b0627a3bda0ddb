"""The three GraySort jobs as library calls: gensort, graysort (phase 1 + phase 2 [+ valsort]) and valsort.

Each runs as a pond job (`threefs.pond.init`) on the local process pool or Ray. Paths are `threefs://...`
(through the client) or local. A job given `job_id` that finds its directory under `data_root` resumes it:
tasks with a completion marker are not run again.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import List, Optional

import threefs.pond as pond
from threefs.pond.common import PondError, split_into_rows
from threefs.pond.dataframe import DataFrame
from threefs.pond.graysort import fileio
from threefs.pond.graysort.job import (MANIFEST, Fault, GenSortNode, Manifest, RecordFiles, RecordPartitionNode,
                                       SortNode, Validation, ValsortNode, _fan_out, combine_validation, files_node,
                                       input_files, sample_splits)
from threefs.pond.io import filesystem as pfs

CHUNK_SIZE = 4 << 20   # chunk size of the directories graysort creates on threefs (big sequential IO)


def _job_time(data_root: str, job_id: Optional[str]) -> Optional[datetime]:
    """The time of an earlier run of job `job_id` under data_root (its directory is <time>.<job_id>)."""
    if not job_id or not pfs.exists(data_root):
        return None
    for name in sorted(pfs.listdir(data_root), reverse=True):
        stamp, _, jid = name.partition(".")
        if jid == job_id:
            try:
                return datetime.strptime(stamp, "%Y-%m-%d-%H-%M-%S")
            except ValueError:
                continue
    return None


def session(data_root: str, job_id: Optional[str] = None, *, executor: str = "local", num_cpus: Optional[int] = None,
            ray_address: Optional[str] = None, progress: bool = False, job_name: str = "graysort",
            memory: Optional[int] = None):
    """A pond session; with the job id of an earlier (killed or failed) run under data_root, it resumes it."""
    fileio.makedirs(data_root, CHUNK_SIZE)
    job_time = _job_time(data_root, job_id) or datetime.now().replace(microsecond=0)
    return pond.init(job_id=job_id, job_time=job_time, data_root=data_root, executor=executor, num_cpus=num_cpus,
                     ray_address=ray_address, progress=progress, job_name=job_name, memory=memory)


def _phase(sp, name: str, node):
    sp._scheduler.progress_desc = name
    before = (sp._scheduler.stats.executed, sp._scheduler.stats.resumed, sp._scheduler.stats.retried)
    t = time.perf_counter()
    try:
        outputs = DataFrame(sp, node)._compute()
    except BaseException:
        sp._failed = True
        raise
    dt = time.perf_counter() - t
    s = sp._scheduler.stats
    return outputs, PhaseStats(name, dt, s.executed - before[0], s.resumed - before[1], s.retried - before[2])


@dataclass
class PhaseStats:
    name: str
    seconds: float
    executed: int
    resumed: int
    retried: int

    def line(self, nbytes: Optional[int] = None) -> str:
        rate = f", {nbytes / 1e9 / (self.seconds / 60):.2f} GB/min" if nbytes and self.seconds > 0 else ""
        extra = f", {self.resumed} resumed" if self.resumed else ""
        extra += f", {self.retried} retried" if self.retried else ""
        return f"{self.name}: {self.seconds:.2f} s ({self.executed} tasks{extra}{rate})"


# ---------------------------------------------------------------------------------------------------------------

def gensort(out_dir: str, records: int, partitions: int, *, skew: bool = False, first_record: int = 0,
            data_root: Optional[str] = None, job_id: Optional[str] = None, executor: str = "local",
            num_cpus: Optional[int] = None, ray_address: Optional[str] = None, progress: bool = False,
            fault: Optional[Fault] = None, stats: Optional[list] = None) -> Manifest:
    """Write `records` gensort records (gensort -b<first_record> [-s]) as `partitions` files
    out_dir/part-NNNNN.dat, in parallel tasks, and out_dir/_manifest.json with the count and checksum."""
    if records < 0 or partitions < 1:
        raise PondError(f"need records >= 0 and partitions >= 1, got {records} and {partitions}")
    data_root = data_root or os.path.join(os.path.dirname(out_dir.rstrip("/")), "pond")
    fileio.makedirs(out_dir, CHUNK_SIZE)
    counts = split_into_rows(records, partitions)
    sp = session(data_root, job_id, executor=executor, num_cpus=num_cpus, ray_address=ray_address,
                 progress=progress, job_name="gensort")
    try:
        node = GenSortNode(sp._ctx, (_fan_out(sp._ctx, partitions),), out_dir, first_record, counts, skew, fault)
        outs, st = _phase(sp, "gensort", node)
    finally:
        sp.shutdown()
    if stats is not None:
        stats.append(st)
    files = [o.pieces[0][0] for o in outs]
    m = Manifest(format="gensort-1.5-binary" + ("-skewed" if skew else ""), records=records,
                 first_record=first_record, skew=skew, checksum=f"{sum(o.checksum for o in outs):x}", files=files,
                 records_per_file=counts)
    m.dump(os.path.join(out_dir, MANIFEST))
    return m


@dataclass
class SortReport:
    input_bytes: int
    records: int
    partitions: int
    phases: List[PhaseStats] = field(default_factory=list)
    validation: Optional[Validation] = None
    outputs: List[str] = field(default_factory=list)

    @property
    def sort_seconds(self) -> float:
        return sum(p.seconds for p in self.phases if p.name.startswith("phase"))

    @property
    def gb_per_min(self) -> float:
        return self.input_bytes / 1e9 / (self.sort_seconds / 60) if self.sort_seconds else float("inf")

    def summary(self) -> str:
        lines = [p.line(self.input_bytes) for p in self.phases]
        lines.append(f"sort (phase 1 + phase 2): {self.sort_seconds:.2f} s for {self.input_bytes / 1e9:.3f} GB "
                     f"({self.records} records, {self.partitions} partitions): {self.gb_per_min:.2f} GB/min")
        if self.validation is not None:
            lines.append(self.validation.summary())
        return "\n".join(lines)


def graysort(input_dir: str, output_dir: str, partitions: int, *, sample: bool = False,
             data_root: Optional[str] = None, job_id: Optional[str] = None, executor: str = "local",
             num_cpus: Optional[int] = None, ray_address: Optional[str] = None, progress: bool = False,
             validate: bool = True, fault: Optional[Fault] = None, memory: Optional[int] = None,
             remove_input: bool = False) -> SortReport:
    """Sort the records of input_dir into output_dir/part-NNNNN.dat (partition j's keys all below partition
    j+1's): phase 1 partitions by key range through shuffle files, phase 2 sorts each partition; then (validate)
    valsort checks the output against the input's count and checksum (from its manifest).

    remove_input: delete the input files once phase 1 is done (a disk that cannot hold input, shuffle and
    output at once); the manifest stays, so validation still compares with the input's checksum."""
    files, manifest = input_files(input_dir)
    data_root = data_root or os.path.join(os.path.dirname(output_dir.rstrip("/")), "pond")
    fileio.makedirs(output_dir, CHUNK_SIZE)
    sp = session(data_root, job_id, executor=executor, num_cpus=num_cpus, ray_address=ray_address,
                 progress=progress, memory=memory)
    report = SortReport(input_bytes=files.nbytes, records=files.num_rows, partitions=partitions)
    try:
        ctx = sp._ctx
        t = time.perf_counter()
        splits = sample_splits(files, partitions) if sample else None
        sample_s = time.perf_counter() - t
        part = RecordPartitionNode(ctx, (files_node(ctx, files),), partitions, splits, fault=fault)
        _, st = _phase(sp, "phase 1 (partition)", part)
        st.seconds += sample_s
        report.phases.append(st)
        if remove_input:
            for path in files.paths:
                fileio.remove(path)
        sort = SortNode(ctx, (part,), output_dir, fault=fault)
        outs, st = _phase(sp, "phase 2 (sort)", sort)
        report.phases.append(st)
        report.outputs = [o.pieces[0][0] for o in outs]
        if validate:
            val, st = _phase(sp, "valsort", ValsortNode(ctx, (sort,)))
            report.phases.append(st)
            rows = [r for ds in val for r in ds.to_arrow_table().to_pylist()]
            report.validation = combine_validation(
                rows, expected_records=manifest.records if manifest else files.num_rows,
                expected_checksum=manifest.checksum_int if manifest else None)
    finally:
        sp.shutdown()
    return report


def output_files(output_dir: str) -> RecordFiles:
    names = [n for n in fileio.listdir(output_dir) if n.startswith("part-") and n.endswith(".dat")]
    if not names:
        raise PondError(f"no part-*.dat files in {output_dir}")
    return RecordFiles([(os.path.join(output_dir, n), 0, fileio.size(os.path.join(output_dir, n))) for n in names])


def valsort(output_dir: str, *, input_dir: Optional[str] = None, data_root: Optional[str] = None,
            executor: str = "local", num_cpus: Optional[int] = None, ray_address: Optional[str] = None,
            progress: bool = False) -> Validation:
    """Check output_dir/part-*.dat (in name order) for global order; with input_dir, also the record count and
    checksum against the input's manifest (or its files, summed here)."""
    files = output_files(output_dir)
    expected_records = expected_checksum = None
    if input_dir is not None:
        src, manifest = input_files(input_dir)
        expected_records = src.num_rows
        expected_checksum = manifest.checksum_int if manifest else None
    data_root = data_root or os.path.join(os.path.dirname(output_dir.rstrip("/")), "pond")
    sp = session(data_root, None, executor=executor, num_cpus=num_cpus, ray_address=ray_address, progress=progress,
                 job_name="valsort")
    try:
        val, _ = _phase(sp, "valsort", ValsortNode(sp._ctx, (files_node(sp._ctx, files),)))
    finally:
        sp.shutdown()
    rows = [r for ds in val for r in ds.to_arrow_table().to_pylist()]
    return combine_validation(rows, expected_records, expected_checksum)
