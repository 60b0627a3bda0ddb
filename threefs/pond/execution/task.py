"""Tasks: the unit of execution. The planner turns each logical node into tasks; an executor runs a task in a
worker process (or a Ray worker) on the data sets its input tasks produced, and the task returns the data set
it wrote. Names follow smallpond.execution.task.

Every task writes into its own staging directory and renames it into place when done, so a task's output
appears atomically; a marker (the pickled output data set) then records the task as completed, which is what
lets a rerun of a failed job skip the tasks that had finished.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
import traceback
from dataclasses import dataclass
from datetime import datetime
from typing import Dict, Iterable, List, Optional

import pyarrow as arrow
import pyarrow.parquet as parquet

from threefs.pond.common import (DATA_PARTITION_COLUMN_NAME, DEFAULT_BATCH_SIZE, DEFAULT_ROW_GROUP_SIZE, GB, MB,
                                 PondError)
from threefs.pond.io import filesystem as pfs
from threefs.pond.logical.dataset import (ArrowTableDataSet, DataSet, ParquetDataSet, PartitionedDataSet,
                                          large_strings)


# ---------------------------------------------------------------------------------------------------------------
# context

class RuntimeContext:
    """Where a job keeps its files, and what the machine offers. Picklable: it travels with every task.

    Layout: `data_root/<YYYY-mm-dd-HH-MM-SS>.<job_id>/{config,log,queue,output,staging,temp}`."""

    def __init__(self, job_id: str, job_time: datetime, data_root: str, num_executors: int = 1,
                 usable_cpu_count: Optional[int] = None, usable_memory_size: Optional[int] = None,
                 job_name: str = "pond", max_retry_count: int = 3, max_fail_count: int = 2, **kwargs) -> None:
        self.job_id = str(job_id)
        self.job_time = job_time
        self.job_name = job_name
        self.data_root = data_root if pfs.is_threefs(data_root) else os.path.abspath(data_root)
        self.num_executors = num_executors
        self.usable_cpu_count = usable_cpu_count or os.cpu_count() or 1
        self.usable_memory_size = usable_memory_size or _machine_memory()
        self.max_retry_count = max_retry_count
        self.max_fail_count = max_fail_count
        self.job_root = os.path.join(self.data_root, f"{job_time:%Y-%m-%d-%H-%M-%S}.{self.job_id}")
        self.config_root = os.path.join(self.job_root, "config")
        self.log_root = os.path.join(self.job_root, "log")
        self.queue_root = os.path.join(self.job_root, "queue")
        self.output_root = os.path.join(self.job_root, "output")
        self.staging_root = os.path.join(self.job_root, "staging")
        self.temp_root = os.path.join(self.job_root, "temp")
        self.completed_task_dir = os.path.join(self.staging_root, "completed_tasks")
        self.started_task_dir = os.path.join(self.staging_root, "started_tasks")
        self.job_status_path = os.path.join(self.log_root, ".STATUS")
        self.task: Optional[Task] = None
        self.threefs_config = pfs.current_config()
        self.threefs_mount = kwargs.pop("threefs_mount", None) or pfs.current_mount()
        self.extra = kwargs

    def initialize(self) -> None:
        for d in (self.config_root, self.log_root, self.queue_root, self.output_root, self.staging_root,
                  self.temp_root, self.completed_task_dir, self.started_task_dir):
            pfs.makedirs(d)

    def cleanup(self, remove_output_root: bool = True) -> None:
        """Remove the job's temporaries (queue, staging, temp: each one recursive remove) and, when asked,
        the task outputs that write_parquet already hard-linked elsewhere."""
        for d in (self.queue_root, self.staging_root, self.temp_root):
            pfs.remove_path(d)
        if remove_output_root:
            pfs.remove_path(self.output_root)

    def default_memory_limit(self, cpu_limit: int) -> int:
        return int(self.usable_memory_size * cpu_limit / self.usable_cpu_count)


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * GB


@dataclass(frozen=True)
class PartitionInfo:
    """Which partition (index of npartitions, in `dimension`) a task works on."""
    index: int = 0
    npartitions: int = 1
    dimension: str = "@toplevel@"

    toplevel_dimension = "@toplevel@"
    default_dimension = DATA_PARTITION_COLUMN_NAME

    def __str__(self) -> str:
        return f"{self.dimension}[{self.index}/{self.npartitions}]"


@dataclass
class PerfStats:
    cnt: int
    sum: float
    min: float
    max: float
    avg: float
    p50: float
    p75: float
    p95: float
    p99: float


# ---------------------------------------------------------------------------------------------------------------
# base task

class Task:
    """A task of the execution plan. `inline` tasks are bookkeeping (split/merge data set descriptors, hard
    links) and run in the driver; the others run on an executor."""

    inline = False

    def __init__(self, runtime_ctx: RuntimeContext, input_deps: "List[Task]", partition_infos: List[PartitionInfo],
                 output_name: Optional[str] = None, output_path: Optional[str] = None, cpu_limit: int = 1,
                 gpu_limit: float = 0, memory_limit: Optional[int] = None) -> None:
        self.runtime_ctx = runtime_ctx
        self.input_deps: List[Task] = list(input_deps)
        self.partition_infos = list(partition_infos or [PartitionInfo()])
        self.output_name = output_name
        self.output_root = output_path
        self.cpu_limit = max(1, int(cpu_limit or 1))
        self.gpu_limit = gpu_limit
        self.memory_limit = memory_limit
        self.node_id = 0
        self.index = 0
        self.location = ""
        self.fingerprint = ""
        self.attempt = 0
        self.random_seed = 0

    # identity -------------------------------------------------------------------------------------------
    @property
    def key(self) -> str:
        return f"{self.__class__.__name__}-{self.node_id:06d}.{self.index:06d}"

    def __repr__(self) -> str:
        return self.key

    @property
    def local_rank(self) -> int:
        return self.partition_infos[-1].index if self.partition_infos else 0

    @property
    def random_seed_uint32(self) -> int:
        return self.random_seed & 0xFFFFFFFF

    @property
    def random_seed_long(self) -> int:
        return self.random_seed

    @property
    def numpy_random_gen(self):
        import numpy as np
        return np.random.default_rng(self.random_seed_uint32)

    @property
    def python_random_gen(self):
        return random.Random(self.random_seed)

    @property
    def output_filename(self) -> str:
        return self.output_name or self.__class__.__name__

    @property
    def partition_index(self) -> int:
        """Index of this task's partition in its node's partitioning."""
        return self.partition_infos[-1].index if self.partition_infos else 0

    def describe(self) -> str:
        """What the task computes, for the fingerprint that guards resumed jobs against a changed plan."""
        return self.__class__.__name__

    def finalize_identity(self) -> None:
        h = hashlib.sha256(self.describe().encode())
        for dep in self.input_deps:
            h.update(dep.fingerprint.encode())
        self.fingerprint = h.hexdigest()[:16]
        self.random_seed = int(h.hexdigest()[16:32], 16)

    # resources -------------------------------------------------------------------------------------------
    def effective_memory_limit(self) -> int:
        return int(self.memory_limit or self.runtime_ctx.default_memory_limit(self.cpu_limit))

    # paths --------------------------------------------------------------------------------------------
    @property
    def final_output_dir(self) -> str:
        root = self.output_root or self.runtime_ctx.output_root
        name = self.output_name or self.__class__.__name__
        return os.path.join(root, f"{name}.{self.node_id:06d}", f"{self.runtime_ctx.job_id}.{self.index:06d}")

    def staging_dir(self) -> str:
        return os.path.join(self.runtime_ctx.staging_root, f"{self.key}.{self.runtime_ctx.job_id}.{self.attempt}")

    @property
    def marker_path(self) -> str:
        return os.path.join(self.runtime_ctx.completed_task_dir, f"{self.key}.pickle")

    # execution ----------------------------------------------------------------------------------------
    def execute(self, input_datasets: List[DataSet]) -> DataSet:
        """Run on an executor. The default: staging dir → process() → rename → output data set."""
        staging = self.staging_dir()
        pfs.remove_path(staging)
        pfs.makedirs(staging)
        self.process_into(input_datasets, staging)
        final = self.final_output_dir
        pfs.makedirs(os.path.dirname(final))
        pfs.remove_path(final)  # a previous attempt that renamed but died before its marker
        pfs.rename(staging, final)
        return self.output_dataset(final)

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        raise NotImplementedError

    def output_dataset(self, final_dir: str) -> DataSet:
        files = [os.path.join(final_dir, f) for f in pfs.listdir(final_dir) if f.endswith(".parquet")]
        return ParquetDataSet(files)

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        raise NotImplementedError

    # helpers for the subclasses --------------------------------------------------------------------------
    def _duckdb(self):
        import duckdb
        threads = max(1, self.cpu_limit)
        mem = self.effective_memory_limit()
        con = duckdb.connect(":memory:", config={"threads": threads, "memory_limit": f"{max(mem, 64 * MB) // MB}MiB",
                                                  "preserve_insertion_order": False})
        exec_sql(con, "set enable_progress_bar=false")
        temp = os.path.join(self.runtime_ctx.temp_root, self.key)
        if not pfs.is_threefs(temp):
            exec_sql(con, f"set temp_directory='{temp}'")
        return con

    def _write_table(self, table: arrow.Table, output_dir: str, seq: int, row_group_size=DEFAULT_ROW_GROUP_SIZE,
                     compression="ZSTD", compression_level=3, dictionary=False) -> str:
        path = os.path.join(output_dir, f"{self.output_filename}-{self.runtime_ctx.job_id}.{self.index:06d}-{seq:06d}.parquet")
        fs, p = pfs.arrow_filesystem_and_path(path)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               b"POND:task": self.key.encode(),
                                               b"POND:partition": str(self.partition_index).encode()})
        if fs is None:
            parquet.write_table(table, p, row_group_size=row_group_size, compression=compression,
                                compression_level=compression_level, use_dictionary=dictionary)
        else:
            with fs.open(p, "wb") as f:
                parquet.write_table(table, f, row_group_size=row_group_size, compression=compression,
                                    compression_level=compression_level, use_dictionary=dictionary)
        return path


def fetch_arrow(result) -> arrow.Table:
    """An Arrow table from a DuckDB result or relation, across DuckDB 1.x and 2.x."""
    for name in ("to_arrow_table", "fetch_arrow_table", "arrow"):
        fn = getattr(result, name, None)
        if fn is not None:
            out = fn()
            return out.read_all() if hasattr(out, "read_all") else out
    raise PondError("this DuckDB version has no Arrow result method")


def exec_sql(con, sql: str):
    """Execute one statement and drain its result (DuckDB 2 refuses new work while a result is pending)."""
    res = con.execute(sql)
    try:
        res.fetchall()
    except Exception:
        pass
    return res


def _register_threefs(con, datasets: Iterable[DataSet], *paths: str) -> None:
    if any(pfs.is_threefs(p) for p in paths) or any(pfs.is_threefs(p) for d in datasets
                                                     for p in getattr(d, "resolved_paths", [])[:1]):
        pfs.register_with_duckdb(con)


# ---------------------------------------------------------------------------------------------------------------
# inline tasks (descriptor bookkeeping in the driver)

class DataSourceTask(Task):
    inline = True

    def __init__(self, runtime_ctx: RuntimeContext, dataset: DataSet, partition_infos: List[PartitionInfo]) -> None:
        super().__init__(runtime_ctx, [], partition_infos)
        self.dataset = dataset

    def describe(self) -> str:
        return f"DataSourceTask:{self.dataset}:{getattr(self.dataset, 'columns', None)}"

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        return self.dataset


class MergeDataSetsTask(Task):
    inline = True

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        return DataSet.merge(input_datasets)


class SplitDataSetTask(Task):
    """Split the (single) input data set by files into `npartitions` pieces; output piece `partition_index`."""
    inline = True

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        info = self.partition_infos[-1]
        return DataSet.merge(input_datasets).partition_by_files(info.npartitions)[info.index]


class PartitionConsumerTask(Task):
    """Partition i of a partitioned node: the i-th data set of every producer, merged."""
    inline = True

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        i = self.partition_index
        parts = []
        for ds in input_datasets:
            assert isinstance(ds, PartitionedDataSet), f"{self.key}: producer output is not partitioned: {ds}"
            parts.append(ds[i])
        merged = DataSet.merge(parts)
        if isinstance(merged, ParquetDataSet):
            # producers with no rows for this partition contribute a schema-only placeholder; keep one at most
            paths = merged.resolved_paths
            real = [p for p in paths if not os.path.basename(p).startswith("_empty")]
            if len(real) != len(paths):
                merged = merged._with_paths(real or paths[:1])
        return merged


class EvenlyDistributedPartitionProducerTask(Task):
    """Distribute the files (or the rows) of all inputs evenly over `npartitions` data sets."""
    inline = True

    def __init__(self, runtime_ctx, input_deps, partition_infos, npartitions: int, dimension: str,
                 partition_by_rows=False, random_shuffle=False, cpu_limit=1, memory_limit=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, cpu_limit=cpu_limit, memory_limit=memory_limit)
        self.npartitions = npartitions
        self.dimension = dimension
        self.partition_by_rows = partition_by_rows
        self.random_shuffle = random_shuffle

    def describe(self) -> str:
        return f"Evenly:{self.npartitions}:{self.partition_by_rows}:{self.random_shuffle}"

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        merged = DataSet.merge(input_datasets)
        if self.partition_by_rows and hasattr(merged, "partition_by_rows"):
            parts = merged.partition_by_rows(self.npartitions, self.random_shuffle)
        else:
            parts = merged.partition_by_files(self.npartitions, self.random_shuffle)
        return PartitionedDataSet(parts)


class ProjectionTask(Task):
    inline = True

    def __init__(self, runtime_ctx, input_deps, partition_infos, columns=None, generated_columns=None,
                 union_by_name=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos)
        self.columns = columns
        self.generated_columns = generated_columns or []
        self.union_by_name = union_by_name

    def describe(self) -> str:
        return f"Projection:{self.columns}:{self.generated_columns}:{self.union_by_name}"

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        ds = DataSet.merge(input_datasets)
        if isinstance(ds, ParquetDataSet):
            ds = ds._with_paths(ds.resolved_paths) if ds.row_ranges is None else ds
            import copy
            ds = copy.copy(ds)
            ds.columns = None if self.columns in (None, ["*"]) else list(self.columns)
            ds.generated_columns = list(self.generated_columns)
            if self.union_by_name is not None:
                ds.union_by_name = self.union_by_name
            return ds
        if isinstance(ds, ArrowTableDataSet) and self.columns not in (None, ["*"]):
            return ArrowTableDataSet(ds.table.select(self.columns))
        return ds


class DataSinkTask(Task):
    """Collect the input files into `output_path`: hard links (or copies across file systems) with names made
    unique, plus a `.MANIFEST.txt` listing them; `manifest` writes only the manifest."""
    inline = True

    def __init__(self, runtime_ctx, input_deps, partition_infos, output_path: str, type: str = "link_manifest",
                 is_final_node=False) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos)
        self.sink_path = output_path
        self.type = type
        self.is_final_node = is_final_node

    def describe(self) -> str:
        return f"DataSink:{self.sink_path}:{self.type}"

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        out = self.sink_path
        pfs.makedirs(out)
        paths: List[str] = []
        used = set(pfs.listdir(out))
        for i, ds in enumerate(input_datasets):
            if isinstance(ds, PartitionedDataSet):
                ds = DataSet.merge(ds.datasets)
            if isinstance(ds, ArrowTableDataSet):
                name = f"{self.output_filename}-{self.runtime_ctx.job_id}.{i:06d}-000000.parquet"
                target = os.path.join(out, name)
                table = ds.table
                parquet.write_table(table, target + ".tmp", compression="ZSTD")
                pfs.rename(target + ".tmp", target)
                paths.append(target)
                continue
            for src in ds.resolved_paths:
                if self.type == "manifest":
                    paths.append(src)
                    continue
                name = os.path.basename(src)
                if name.startswith("_empty"):
                    continue
                base, ext = os.path.splitext(name)
                n = 0
                while name in used:
                    n += 1
                    name = f"{base}.{n}{ext}"
                used.add(name)
                target = os.path.join(out, name)
                if self.type == "copy":
                    import shutil
                    shutil.copyfile(src, target)
                else:
                    pfs.link_or_copy(src, target)
                paths.append(target)
        pfs.write_text(os.path.join(out, ".MANIFEST.txt"), "".join(p + "\n" for p in paths))
        return ParquetDataSet(paths) if paths else ParquetDataSet([])


class SampleBoundaryTask(Task):
    """Range partitioning: n-1 split points as quantiles of the key samples of all producers' inputs."""
    inline = True

    def __init__(self, runtime_ctx, input_deps, partition_infos, npartitions: int) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos)
        self.npartitions = npartitions

    def describe(self) -> str:
        return f"Boundary:{self.npartitions}"

    def run_inline(self, input_datasets: List[DataSet]) -> DataSet:
        import pyarrow.compute as pc
        tables = [d.to_arrow_table() for d in input_datasets if d.num_rows > 0]
        if not tables:
            return ArrowTableDataSet(arrow.table({"bound": arrow.array([], arrow.int64())}))
        col = arrow.concat_tables(tables).column("bound").combine_chunks().drop_null()
        col = col.take(pc.sort_indices(col))
        n = len(col)
        bounds = []
        for i in range(1, self.npartitions):
            b = col[min(n - 1, (i * n) // self.npartitions)]
            if not bounds or b.as_py() != bounds[-1].as_py():
                bounds.append(b)
        arr = arrow.array([b.as_py() for b in bounds], type=col.type)
        return ArrowTableDataSet(arrow.table({"bound": arr}))


# ---------------------------------------------------------------------------------------------------------------
# executor tasks

def _format_queries(queries: List[str], fragments: List[str], task: Task, batch_index: int = 0) -> List[str]:
    out = []
    for qi, q in enumerate(queries):
        try:
            out.append(q.format(*fragments, batch_index=batch_index, query_index=qi,
                                rand_seed=task.random_seed_uint32, __data_partition__=task.partition_index))
        except (IndexError, KeyError) as e:
            raise PondError(f"{task.key}: the query names an input or placeholder that does not exist ({e!r}); "
                            f"it has {len(fragments)} input(s) {{0}}..{{{len(fragments) - 1}}}: {q}") from None
    return out


class SqlEngineTask(Task):
    """Run DuckDB SQL over the inputs (`{0}`, `{1}`, ...) and write the last query's result as Parquet."""

    def __init__(self, runtime_ctx, input_deps, partition_infos, sql_queries: List[str], *, udfs=None,
                 per_thread_output=True, materialize_output=True, materialize_in_memory=False,
                 batched_processing=False, enable_temp_directory=False, parquet_row_group_size=DEFAULT_ROW_GROUP_SIZE,
                 parquet_dictionary_encoding=False, parquet_compression="ZSTD", parquet_compression_level=3,
                 output_name=None, output_path=None, cpu_limit=1, gpu_limit=0, memory_limit=None,
                 cpu_overcommit_ratio=1.0, memory_overcommit_ratio=0.9) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, output_name, output_path, cpu_limit, gpu_limit,
                         memory_limit)
        self.sql_queries = list(sql_queries)
        self.udfs = list(udfs or [])
        self.per_thread_output = per_thread_output
        self.materialize_output = materialize_output
        self.parquet_row_group_size = parquet_row_group_size
        self.parquet_dictionary_encoding = parquet_dictionary_encoding
        self.parquet_compression = parquet_compression
        self.parquet_compression_level = parquet_compression_level
        self.cpu_overcommit_ratio = cpu_overcommit_ratio
        self.memory_overcommit_ratio = memory_overcommit_ratio

    def describe(self) -> str:
        return f"Sql:{self.sql_queries}:{[getattr(u, 'name', u) for u in self.udfs]}"

    def effective_memory_limit(self) -> int:
        return int(super().effective_memory_limit() * self.memory_overcommit_ratio)

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        con = self._duckdb()
        try:
            _register_threefs(con, input_datasets, output_dir)
            for udf in self.udfs:
                udf.bind(con)
            fragments = [ds.sql_query_fragment(conn=con) for ds in input_datasets]
            queries = _format_queries(self.sql_queries, fragments, self)
            for q in queries[:-1]:
                self._run(con, q, q)
            last = queries[-1]
            opts = (f"FORMAT PARQUET, COMPRESSION {self.parquet_compression}, "
                    f"ROW_GROUP_SIZE {self.parquet_row_group_size}")
            if self.parquet_compression.upper() == "ZSTD":
                opts += f", COMPRESSION_LEVEL {self.parquet_compression_level}"
            name = f"{self.output_filename}-{self.runtime_ctx.job_id}.{self.index:06d}"
            if self.per_thread_output and self.cpu_limit > 1:
                target = output_dir
                opts += f", PER_THREAD_OUTPUT true, FILENAME_PATTERN '{name}-{{i}}'"
            else:
                target = os.path.join(output_dir, f"{name}-0.parquet")
            self._run(con, f"COPY ({last}) TO '{pfs.data_view(target)}' ({opts})", self.sql_queries[-1])
        finally:
            con.close()

    def _run(self, con, sql: str, user_query: str):
        try:
            return exec_sql(con, sql)
        except Exception as e:
            raise PondError(f"{self.key} failed: {type(e).__name__}: {e}\n  query: {user_query}\n  "
                            f"executed: {sql[:2000]}") from None


class HashPartitionTask(Task):
    """Partition producer: one pass of DuckDB writes each row into the file of its partition
    (hash of `hash_columns`, a random partition, or the value of `data_partition_column`)."""

    def __init__(self, runtime_ctx, input_deps, partition_infos, npartitions: int, dimension: str,
                 hash_columns: Optional[List[str]], data_partition_column: str, random_shuffle=False,
                 shuffle_only=False, drop_partition_column=False, use_parquet_writer=False, hive_partitioning=False,
                 parquet_row_group_size=DEFAULT_ROW_GROUP_SIZE, parquet_dictionary_encoding=False,
                 parquet_compression="ZSTD", parquet_compression_level=3, output_name=None, output_path=None,
                 cpu_limit=1, memory_limit=None, partition_expr: Optional[str] = None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, output_name, output_path, cpu_limit, 0, memory_limit)
        self.npartitions = npartitions
        self.dimension = dimension
        self.hash_columns = hash_columns
        self.data_partition_column = data_partition_column
        self.random_shuffle = random_shuffle
        self.shuffle_only = shuffle_only
        self.drop_partition_column = drop_partition_column
        self.parquet_row_group_size = parquet_row_group_size
        self.parquet_compression = parquet_compression
        self.parquet_compression_level = parquet_compression_level
        self.partition_expr = partition_expr

    @staticmethod
    def create(engine_type, *args, **kwargs) -> "HashPartitionTask":
        return HashPartitionTask(*args, **kwargs)

    def describe(self) -> str:
        return (f"Hash:{self.npartitions}:{self.hash_columns}:{self.data_partition_column}:{self.random_shuffle}:"
                f"{self.shuffle_only}:{self.partition_expr}:{self.drop_partition_column}")

    def _key_sql(self) -> tuple[str, str, bool]:
        """(select list addition, partition column, whether to keep the column in the output)."""
        n = self.npartitions
        if self.random_shuffle:
            return f", (floor(random() * {n}))::BIGINT AS {DATA_PARTITION_COLUMN_NAME}", DATA_PARTITION_COLUMN_NAME, \
                not self.drop_partition_column
        if self.shuffle_only:
            expr = self.partition_expr or self.data_partition_column
            k = "__pond_key__"
            check = (f"CASE WHEN ({expr}) >= 0 AND ({expr}) < {n} THEN ({expr})::BIGINT ELSE "
                     f"error('partition key ' || ({expr})::VARCHAR || ' is out of range 0-{n - 1}') END")
            return f", {check} AS {k}", k, False
        cols = ", ".join(self.hash_columns)
        return (f", (hash({cols}) % {n})::BIGINT AS {self.data_partition_column}", self.data_partition_column,
                not self.drop_partition_column)

    def source_sql(self, con, input_datasets: List[DataSet]) -> tuple[str, str, bool]:
        src = DataSet.merge([d for d in input_datasets]).sql_query_fragment(conn=con)
        extra, col, keep = self._key_sql()
        return f"select *{extra} from {src}", col, keep

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        con = self._duckdb()
        try:
            _register_threefs(con, input_datasets, output_dir)
            sql, col, keep = self.source_sql(con, input_datasets)
            name = f"{self.output_filename}-{self.runtime_ctx.job_id}.{self.index:06d}"
            opts = (f"FORMAT PARQUET, COMPRESSION {self.parquet_compression}, ROW_GROUP_SIZE {self.parquet_row_group_size}, "
                    f"PARTITION_BY ({col}), WRITE_PARTITION_COLUMNS {'true' if keep else 'false'}, "
                    f"FILENAME_PATTERN '{name}-{{i}}', OVERWRITE_OR_IGNORE true")
            if self.parquet_compression.upper() == "ZSTD":
                opts += f", COMPRESSION_LEVEL {self.parquet_compression_level}"
            try:
                exec_sql(con, f"COPY ({sql}) TO '{pfs.data_view(output_dir)}' ({opts})")
                schema_sql = sql if keep else f"select * exclude ({col}) from ({sql})"
                exec_sql(con, f"COPY (select * from ({schema_sql}) limit 0) TO "
                            f"'{pfs.data_view(os.path.join(output_dir, '_empty.parquet'))}' (FORMAT PARQUET)")
            except Exception as e:
                raise PondError(f"{self.key} failed: {type(e).__name__}: {e}\n  partitioning: {sql[:2000]}") from None
        finally:
            con.close()

    def output_dataset(self, final_dir: str) -> DataSet:
        empty = os.path.join(final_dir, "_empty.parquet")
        col = None
        parts: Dict[int, List[str]] = {}
        for entry in pfs.listdir(final_dir):
            if "=" not in entry:
                continue
            col, value = entry.split("=", 1)
            sub = os.path.join(final_dir, entry)
            parts[int(value)] = [os.path.join(sub, f) for f in pfs.listdir(sub) if f.endswith(".parquet")]
        return PartitionedDataSet([ParquetDataSet(parts.get(i) or [empty]) for i in range(self.npartitions)])


class RangePartitionTask(HashPartitionTask):
    """Partition producer by key range: partition i holds keys in [split_i, split_{i+1}) of the sorted split
    points (the last input data set), found per row by an ASOF join."""

    def __init__(self, *args, range_expr: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.range_expr = range_expr

    def describe(self) -> str:
        return f"Range:{self.npartitions}:{self.range_expr}:{self.drop_partition_column}"

    def source_sql(self, con, input_datasets: List[DataSet]) -> tuple[str, str, bool]:
        *data, bounds = input_datasets
        con.register("__pond_bounds_arrow", bounds.to_arrow_table())
        exec_sql(con, "create temp table __pond_bounds as select (row_number() over (order by bound))::BIGINT as idx, "
                    "bound from __pond_bounds_arrow")
        src = DataSet.merge(data).sql_query_fragment(conn=con)
        col = self.data_partition_column
        sql = (f"select s.* exclude (__pond_key__), coalesce(b.idx, 0)::BIGINT as {col} from "
               f"(select *, ({self.range_expr}) as __pond_key__ from {src}) s "
               f"asof left join __pond_bounds b on s.__pond_key__ >= b.bound")
        return sql, col, not self.drop_partition_column


class SampleTask(Task):
    """Range partitioning: a reservoir sample of the key over this task's input."""

    def __init__(self, runtime_ctx, input_deps, partition_infos, range_expr: str, sample_rows: int) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos)
        self.range_expr = range_expr
        self.sample_rows = sample_rows

    def describe(self) -> str:
        return f"Sample:{self.range_expr}:{self.sample_rows}"

    def execute(self, input_datasets: List[DataSet]) -> DataSet:
        con = self._duckdb()
        try:
            _register_threefs(con, input_datasets)
            ds = DataSet.merge(input_datasets)
            src = ds.sql_query_fragment(conn=con)
            seed = self.random_seed_uint32 % 2_000_000_000
            try:
                table = fetch_arrow(con.sql(f"select ({self.range_expr}) as bound from {src} using sample "
                                                f"reservoir({self.sample_rows} rows) repeatable ({seed})"))
            except Exception as e:
                raise PondError(f"{self.key}: cannot sample the range key {self.range_expr!r}: {e}") from None
            return ArrowTableDataSet(table)
        finally:
            con.close()


class PythonScriptTask(Task):
    """User code gets the input data sets and an output directory; whatever it writes there is the output."""

    def __init__(self, runtime_ctx, input_deps, partition_infos, process_func=None, output_name=None,
                 output_path=None, cpu_limit=1, gpu_limit=0, memory_limit=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, output_name, output_path, cpu_limit, gpu_limit,
                         memory_limit)
        self.process_func = process_func

    def describe(self) -> str:
        return f"{self.__class__.__name__}:{_func_name(self.process_func)}"

    def process(self, runtime_ctx: RuntimeContext, input_datasets: List[DataSet], output_path: str) -> bool:
        return self.process_func(runtime_ctx, input_datasets, output_path)

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        self.runtime_ctx.task = self
        ok = self.process(self.runtime_ctx, input_datasets, output_dir)
        if ok is False:
            raise PondError(f"{self.key}: process() returned False")


def _func_name(f) -> str:
    if f is None:
        return "None"
    name = getattr(f, "__qualname__", None) or type(f).__name__
    code = getattr(f, "__code__", None)
    return f"{getattr(f, '__module__', '')}.{name}:{code.co_firstlineno if code else ''}"


class ArrowComputeTask(Task):
    """User code gets the inputs as Arrow tables and returns one table."""

    def __init__(self, runtime_ctx, input_deps, partition_infos, process_func=None, parquet_row_group_size=None,
                 parquet_dictionary_encoding=False, parquet_compression="ZSTD", parquet_compression_level=3,
                 use_duckdb_reader=False, output_name=None, output_path=None, cpu_limit=1, gpu_limit=0,
                 memory_limit=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, output_name, output_path, cpu_limit, gpu_limit,
                         memory_limit)
        self.process_func = process_func
        self.parquet_row_group_size = parquet_row_group_size or DEFAULT_ROW_GROUP_SIZE
        self.parquet_dictionary_encoding = parquet_dictionary_encoding
        self.parquet_compression = parquet_compression
        self.parquet_compression_level = parquet_compression_level

    def describe(self) -> str:
        return f"{self.__class__.__name__}:{_func_name(self.process_func)}"

    def process(self, runtime_ctx: RuntimeContext, input_tables: List[arrow.Table]) -> arrow.Table:
        return self.process_func(runtime_ctx, input_tables)

    def _convert_inputs(self, input_datasets: List[DataSet]):
        return [large_strings(ds.to_arrow_table()) for ds in input_datasets]

    def _convert_output(self, result) -> arrow.Table:
        return result

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        self.runtime_ctx.task = self
        result = self._convert_output(self.process(self.runtime_ctx, self._convert_inputs(input_datasets)))
        if result is None:
            raise PondError(f"{self.key}: process() returned None instead of a table")
        self._write(result, output_dir, 0)

    def _write(self, table: arrow.Table, output_dir: str, seq: int) -> None:
        self._write_table(table, output_dir, seq, self.parquet_row_group_size, self.parquet_compression,
                          self.parquet_compression_level, self.parquet_dictionary_encoding)


class PandasComputeTask(ArrowComputeTask):
    def _convert_inputs(self, input_datasets):
        return [ds.to_pandas() for ds in input_datasets]

    def _convert_output(self, result):
        return None if result is None else arrow.Table.from_pandas(result, preserve_index=False)


class ArrowStreamTask(ArrowComputeTask):
    """User code gets RecordBatchReaders (batches of `streaming_batch_size` rows) and yields tables."""

    def __init__(self, runtime_ctx, input_deps, partition_infos, process_func=None, background_io_thread=False,
                 streaming_batch_size=DEFAULT_BATCH_SIZE, secs_checkpoint_interval=180, parquet_row_group_size=None,
                 parquet_dictionary_encoding=False, parquet_compression="ZSTD", parquet_compression_level=3,
                 use_duckdb_reader=False, output_name=None, output_path=None, cpu_limit=1, gpu_limit=0,
                 memory_limit=None) -> None:
        super().__init__(runtime_ctx, input_deps, partition_infos, process_func, parquet_row_group_size,
                         parquet_dictionary_encoding, parquet_compression, parquet_compression_level,
                         use_duckdb_reader, output_name, output_path, cpu_limit, gpu_limit, memory_limit)
        self.streaming_batch_size = streaming_batch_size or DEFAULT_BATCH_SIZE

    def process(self, runtime_ctx, input_readers):
        return self.process_func(runtime_ctx, input_readers)

    def _readers(self, input_datasets):
        return [_rebatch(ds.to_batch_reader(self.streaming_batch_size), self.streaming_batch_size)
                for ds in input_datasets]

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        self.runtime_ctx.task = self
        out = self.process(self.runtime_ctx, self._readers(input_datasets))
        self._write_stream(out, output_dir)

    def _write_stream(self, tables, output_dir: str) -> None:
        seq = 0
        schema = None
        for t in tables or []:
            if isinstance(t, arrow.RecordBatch):
                t = arrow.Table.from_batches([t])
            if schema is None:
                schema = t.schema
            self._write(t, output_dir, seq)
            seq += 1
        if seq == 0:
            self._write(arrow.table({}), output_dir, 0)


class ArrowBatchTask(ArrowStreamTask):
    """User code gets one Arrow table per batch of `streaming_batch_size` rows (all inputs zipped)."""

    def process(self, runtime_ctx, input_tables):
        return self.process_func(runtime_ctx, input_tables)

    def process_into(self, input_datasets: List[DataSet], output_dir: str) -> None:
        self.runtime_ctx.task = self
        readers = self._readers(input_datasets)

        def results():
            iters = [iter(r) for r in readers]
            schemas = [r.schema for r in readers]
            while True:
                batches = [next(it, None) for it in iters]
                if all(b is None for b in batches):
                    return
                tables = [arrow.Table.from_batches([b]) if b is not None else s.empty_table()
                          for b, s in zip(batches, schemas)]
                yield self._convert_output(self.process(self.runtime_ctx, self._convert_batch(tables)))

        self._write_stream(results(), output_dir)

    def _convert_batch(self, tables):
        return tables


class PandasBatchTask(ArrowBatchTask):
    def _convert_batch(self, tables):
        return [t.to_pandas() for t in tables]

    def _convert_output(self, result):
        return None if result is None else arrow.Table.from_pandas(result, preserve_index=False)


def _rebatch(reader: arrow.RecordBatchReader, batch_size: int) -> arrow.RecordBatchReader:
    """Exactly `batch_size` rows per batch (the last may be shorter), across file boundaries."""

    def gen():
        pending: List[arrow.RecordBatch] = []
        count = 0
        for b in reader:
            while b.num_rows > 0:
                take = min(batch_size - count, b.num_rows)
                pending.append(b.slice(0, take))
                count += take
                b = b.slice(take)
                if count == batch_size:
                    yield arrow.Table.from_batches(pending).combine_chunks().to_batches()[0]
                    pending, count = [], 0
        if count:
            yield arrow.Table.from_batches(pending).combine_chunks().to_batches()[0]

    return arrow.RecordBatchReader.from_batches(reader.schema, gen())


# ---------------------------------------------------------------------------------------------------------------
# the worker entry point

def execute_payload(payload: bytes) -> bytes:
    """Run one task in a worker: unpickle (task, input data sets), execute, pickle the outcome. Errors come
    back as text (an exception object may not unpickle in the driver)."""
    import cloudpickle
    started = time.time()
    try:
        task, inputs = cloudpickle.loads(payload)
    except Exception as e:
        return cloudpickle.dumps(("error", f"cannot unpickle the task in the worker: {type(e).__name__}: {e}",
                                  started, time.time(), os.getpid()))
    try:
        pfs.configure(getattr(task.runtime_ctx, "threefs_config", None), getattr(task.runtime_ctx, "threefs_mount", None))
        output = task.execute(inputs)
        _write_marker(task, output)
        return cloudpickle.dumps(("ok", output, started, time.time(), os.getpid()))
    except PondError as e:
        return cloudpickle.dumps(("error", str(e), started, time.time(), os.getpid()))
    except BaseException as e:  # noqa: BLE001 - user code may raise anything; report it with its traceback
        tb = traceback.format_exc(limit=8)
        return cloudpickle.dumps(("error", f"{task.key} failed: {type(e).__name__}: {e}\n{tb}", started, time.time(),
                                  os.getpid()))


def _write_marker(task: Task, output: DataSet) -> None:
    import cloudpickle
    pfs.write_bytes(task.marker_path, cloudpickle.dumps((task.fingerprint, output)))


def read_marker(task: Task) -> Optional[DataSet]:
    """The output of a task completed by an earlier run of the same job, if its plan is unchanged."""
    import cloudpickle
    try:
        fingerprint, output = cloudpickle.loads(pfs.read_bytes(task.marker_path))
    except (OSError, FileNotFoundError, EOFError, ValueError):
        return None
    except Exception:
        return None
    if fingerprint != task.fingerprint:
        return None
    if not all(pfs.exists(p) for p in output.resolved_paths[:64]):
        return None
    return output
