"""Logical plan: nodes and the plan around them (names and constructor arguments follow smallpond.logical.node).

A node describes a computation over partitions; the planner (logical/planner.py) turns it into tasks.
Differences from smallpond: RangePartitionNode works (sampled split points, or given ones), and nodes never
need graphviz.
"""

from __future__ import annotations

import os
import re
import traceback
from collections import defaultdict
from typing import Callable, Dict, Generic, Iterable, List, Literal, Optional, Tuple, TypeVar, Union

import pyarrow as arrow

from threefs.pond.common import (DATA_PARTITION_COLUMN_NAME, DEFAULT_BATCH_SIZE, DEFAULT_ROW_GROUP_SIZE, GB,
                                 GENERATED_COLUMNS, MAX_PARTITIONS, PondError)
from threefs.pond.execution.task import (ArrowBatchTask, ArrowComputeTask, ArrowStreamTask, DataSinkTask,
                                         DataSourceTask, EvenlyDistributedPartitionProducerTask, HashPartitionTask,
                                         MergeDataSetsTask, PandasBatchTask, PandasComputeTask, PartitionConsumerTask,
                                         PartitionInfo, PerfStats, ProjectionTask, PythonScriptTask, RangePartitionTask,
                                         RuntimeContext, SampleBoundaryTask, SampleTask, SplitDataSetTask,
                                         SqlEngineTask, Task)
from threefs.pond.logical.dataset import DataSet, ParquetDataSet
from threefs.pond.logical.udf import (DuckDbExtensionContext, ExternalModuleContext, PythonUDFContext, UDFContext,
                                      UDFType, UserDefinedFunction)


class NodeId(int):
    def __str__(self) -> str:
        return f"{self:06d}"


class Context:
    """Global context of a logical plan: node ids and the UDFs the plan references."""

    def __init__(self) -> None:
        self.next_node_id = 0
        self.udfs: Dict[str, UDFContext] = {}

    def _new_node_id(self) -> NodeId:
        self.next_node_id += 1
        return NodeId(self.next_node_id)

    def create_function(self, name: str, func: Callable, params: Optional[List[UDFType]],
                        return_type: Optional[UDFType], use_arrow_type=False) -> str:
        self.udfs[name] = PythonUDFContext(name, func, params, return_type, use_arrow_type)
        return name

    def create_external_module(self, module_path: str, name: str = None) -> str:
        name = name or os.path.basename(module_path)
        self.udfs[name] = ExternalModuleContext(name, module_path)
        return name

    def create_duckdb_extension(self, extension_path: str, name: str = None) -> str:
        name = name or os.path.basename(extension_path)
        self.udfs[name] = DuckDbExtensionContext(name, extension_path)
        return name


def _user_location() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(here):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


class Node:
    """The base class of all nodes."""

    enable_resource_boost = False

    def __init__(self, ctx: Context, input_deps: "Tuple[Node, ...]", output_name: Optional[str] = None,
                 output_path: Optional[str] = None, cpu_limit: int = 1, gpu_limit: float = 0,
                 memory_limit: Optional[int] = None) -> None:
        if not isinstance(input_deps, Iterable) or not all(isinstance(n, Node) for n in input_deps):
            raise PondError(f"input_deps must be a tuple of nodes, got {input_deps!r}")
        if output_name is not None and not re.fullmatch("[a-zA-Z0-9_]+", output_name):
            raise PondError(f"output_name may hold letters, digits and '_' only: {output_name!r}")
        if output_path is not None and not (os.path.isabs(output_path) or output_path.startswith("threefs://")):
            raise PondError(f"output_path must be an absolute path: {output_path!r}")
        self.ctx = ctx
        self.id = ctx._new_node_id()
        self.input_deps = tuple(input_deps)
        self.output_name = output_name
        self.output_path = output_path
        self.cpu_limit = max(cpu_limit or 1, int(gpu_limit * 8))
        self.gpu_limit = gpu_limit
        self.memory_limit = memory_limit
        self.generated_tasks: List[str] = []
        self.perf_stats: Dict[str, PerfStats] = {}
        self.perf_metrics: Dict[str, List[float]] = defaultdict(list)
        self.location = _user_location()

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}-{self.id}"

    def __str__(self) -> str:
        return (f"{repr(self)}: input_deps={list(self.input_deps)}, output_name={self.output_name}, "
                f"tasks[{len(self.generated_tasks)}], resource_limit={self.cpu_limit}CPUs/"
                f"{(self.memory_limit or 0) // GB}GB")

    def describe(self) -> str:
        """One line for explain()."""
        return repr(self)

    def _stamp(self, task: Task, index: int) -> Task:
        task.node_id = int(self.id)
        task.index = index
        task.location = self.location
        self.generated_tasks.append(task.key)
        return task

    def create_task(self, runtime_ctx: RuntimeContext, input_deps: List[Task],
                    partition_infos: List[PartitionInfo]) -> Task:
        raise NotImplementedError(f"{self.__class__.__name__}.create_task")

    def add_perf_metrics(self, name, value) -> None:
        self.perf_metrics[name].append(value)

    def get_perf_stats(self, name):
        import numpy as np
        values = self.perf_metrics.get(name)
        if not values:
            return None
        p50, p75, p95, p99 = np.percentile(values, (50, 75, 95, 99))
        return PerfStats(len(values), sum(values), min(values), max(values), float(np.mean(values)), p50, p75, p95, p99)

    @property
    def num_partitions(self) -> int:
        raise NotImplementedError("num_partitions")


class DataSourceNode(Node):
    """An input of the plan (one partition holding the whole data set)."""

    def __init__(self, ctx: Context, dataset: Optional[DataSet]) -> None:
        super().__init__(ctx, [])
        self.dataset = dataset if dataset is not None else ParquetDataSet([])

    def __str__(self) -> str:
        return super().__str__() + f", dataset=<{self.dataset}>"

    def describe(self) -> str:
        return f"{repr(self)} {type(self.dataset).__name__} {self.dataset.paths[:2]}"

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> DataSourceTask:
        return DataSourceTask(runtime_ctx, self.dataset, partition_infos)

    @property
    def num_partitions(self) -> int:
        return 1


DataSinkType = Literal["link", "copy", "link_or_copy", "manifest"]


class DataSinkNode(Node):
    """Collect the output files of input_deps in output_path: hard links (copies across file systems) and a
    `.MANIFEST.txt`, or the manifest alone."""

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], output_path: str, type: DataSinkType = "link",
                 manifest_only=False, is_final_node=False) -> None:
        if type not in ("link", "copy", "link_or_copy", "manifest"):
            raise PondError(f"invalid sink type: {type!r} (link, copy, link_or_copy or manifest)")
        super().__init__(ctx, input_deps, None, output_path, cpu_limit=1, gpu_limit=0, memory_limit=0)
        self.type = "manifest" if manifest_only else type
        self.is_final_node = is_final_node

    def describe(self) -> str:
        return f"{repr(self)} -> {self.output_path} ({self.type})"

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> DataSinkTask:
        kind = {"manifest": "manifest", "copy": "copy"}.get(self.type, "link_manifest")
        return DataSinkTask(runtime_ctx, input_deps, partition_infos, self.output_path, type=kind,
                            is_final_node=self.is_final_node)

    @property
    def num_partitions(self) -> int:
        return 1


class PythonScriptNode(Node):
    """Python code over the input data sets, writing files into its output directory."""

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], *, process_func=None, output_name=None,
                 output_path=None, cpu_limit: int = 1, gpu_limit: float = 0, memory_limit: Optional[int] = None):
        super().__init__(ctx, input_deps, output_name, output_path, cpu_limit, gpu_limit, memory_limit)
        self.process_func = process_func

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> PythonScriptTask:
        return self.spawn(runtime_ctx, input_deps, partition_infos, self.process_func or self.process,
                          self.output_name, self.output_path, self.cpu_limit, self.gpu_limit, self.memory_limit)

    def spawn(self, *args, **kwargs) -> PythonScriptTask:
        return PythonScriptTask(*args, **kwargs)

    def process(self, runtime_ctx: RuntimeContext, input_datasets: List[DataSet], output_path: str) -> bool:
        raise NotImplementedError

    @property
    def num_partitions(self) -> int:
        return _aligned_partitions(self)


class ArrowComputeNode(Node):
    """Python code over the inputs loaded as Arrow tables, returning one table."""

    default_row_group_size = DEFAULT_ROW_GROUP_SIZE

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], *, process_func=None, parquet_row_group_size=None,
                 parquet_dictionary_encoding=False, parquet_compression="ZSTD", parquet_compression_level=3,
                 use_duckdb_reader=False, output_name=None, output_path=None, cpu_limit: int = 1,
                 gpu_limit: float = 0, memory_limit: Optional[int] = None) -> None:
        super().__init__(ctx, input_deps, output_name, output_path, cpu_limit, gpu_limit, memory_limit)
        self.parquet_row_group_size = parquet_row_group_size or self.default_row_group_size
        self.parquet_dictionary_encoding = parquet_dictionary_encoding
        self.parquet_compression = parquet_compression
        self.parquet_compression_level = parquet_compression_level
        self.use_duckdb_reader = use_duckdb_reader
        self.process_func = process_func

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> ArrowComputeTask:
        return self.spawn(runtime_ctx, input_deps, partition_infos, self.process_func or self.process,
                          self.parquet_row_group_size, self.parquet_dictionary_encoding, self.parquet_compression,
                          self.parquet_compression_level, self.use_duckdb_reader, self.output_name, self.output_path,
                          self.cpu_limit, self.gpu_limit, self.memory_limit)

    def spawn(self, *args, **kwargs) -> ArrowComputeTask:
        return ArrowComputeTask(*args, **kwargs)

    def process(self, runtime_ctx: RuntimeContext, input_tables: List[arrow.Table]) -> arrow.Table:
        raise NotImplementedError

    @property
    def num_partitions(self) -> int:
        return _aligned_partitions(self)


class ArrowStreamNode(Node):
    """Python code over RecordBatchReaders of the inputs, yielding tables."""

    default_batch_size = DEFAULT_BATCH_SIZE
    default_row_group_size = DEFAULT_ROW_GROUP_SIZE
    default_secs_checkpoint_interval = 180

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], *, process_func=None, background_io_thread=True,
                 streaming_batch_size: int = None, secs_checkpoint_interval: int = None,
                 parquet_row_group_size: int = None, parquet_dictionary_encoding=False, parquet_compression="ZSTD",
                 parquet_compression_level=3, use_duckdb_reader=False, output_name: str = None,
                 output_path: str = None, cpu_limit: int = 1, gpu_limit: float = 0,
                 memory_limit: Optional[int] = None) -> None:
        super().__init__(ctx, input_deps, output_name, output_path, cpu_limit, gpu_limit, memory_limit)
        self.background_io_thread = background_io_thread and self.cpu_limit > 1
        self.streaming_batch_size = streaming_batch_size or self.default_batch_size
        self.secs_checkpoint_interval = secs_checkpoint_interval or self.default_secs_checkpoint_interval
        self.parquet_row_group_size = parquet_row_group_size or self.default_row_group_size
        self.parquet_dictionary_encoding = parquet_dictionary_encoding
        self.parquet_compression = parquet_compression
        self.parquet_compression_level = parquet_compression_level
        self.use_duckdb_reader = use_duckdb_reader
        self.process_func = process_func

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> ArrowStreamTask:
        return self.spawn(runtime_ctx, input_deps, partition_infos, self.process_func or self.process,
                          self.background_io_thread, self.streaming_batch_size, self.secs_checkpoint_interval,
                          self.parquet_row_group_size, self.parquet_dictionary_encoding, self.parquet_compression,
                          self.parquet_compression_level, self.use_duckdb_reader, self.output_name, self.output_path,
                          self.cpu_limit, self.gpu_limit, self.memory_limit)

    def spawn(self, *args, **kwargs) -> ArrowStreamTask:
        return ArrowStreamTask(*args, **kwargs)

    def process(self, runtime_ctx: RuntimeContext, input_readers: List[arrow.RecordBatchReader]):
        raise NotImplementedError

    @property
    def num_partitions(self) -> int:
        return _aligned_partitions(self)


class ArrowBatchNode(ArrowStreamNode):
    """Python code over one Arrow table per batch of `streaming_batch_size` rows."""

    def spawn(self, *args, **kwargs) -> ArrowBatchTask:
        return ArrowBatchTask(*args, **kwargs)

    def process(self, runtime_ctx: RuntimeContext, input_tables: List[arrow.Table]) -> arrow.Table:
        raise NotImplementedError


class PandasComputeNode(ArrowComputeNode):
    def spawn(self, *args, **kwargs) -> PandasComputeTask:
        return PandasComputeTask(*args, **kwargs)

    def process(self, runtime_ctx, input_dfs):
        raise NotImplementedError


class PandasBatchNode(ArrowStreamNode):
    def spawn(self, *args, **kwargs) -> PandasBatchTask:
        return PandasBatchTask(*args, **kwargs)

    def process(self, runtime_ctx, input_dfs):
        raise NotImplementedError


class SqlEngineNode(Node):
    """DuckDB SQL over the outputs of input_deps (`{0}`, `{1}`, ...), per partition."""

    max_udf_cpu_limit = 3
    default_cpu_limit = 1
    default_memory_limit = None
    default_row_group_size = DEFAULT_ROW_GROUP_SIZE
    enable_resource_boost = True

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], sql_query: Union[str, Iterable[str]], *,
                 udfs: List[Union[str, UserDefinedFunction]] = None, per_thread_output=True, materialize_output=True,
                 materialize_in_memory=False, relax_memory_if_oom=None, batched_processing=False,
                 extension_paths: List[str] = None, udf_module_paths: List[str] = None, enable_temp_directory=False,
                 parquet_row_group_size: int = None, parquet_dictionary_encoding: bool = False,
                 parquet_compression="ZSTD", parquet_compression_level=3, output_name: Optional[str] = None,
                 output_path: Optional[str] = None, cpu_limit: Optional[int] = None,
                 memory_limit: Optional[int] = None, cpu_overcommit_ratio: float = 1.0,
                 memory_overcommit_ratio: float = 0.9) -> None:
        cpu_limit = cpu_limit or self.default_cpu_limit
        memory_limit = memory_limit or self.default_memory_limit
        if udfs and cpu_limit > self.max_udf_cpu_limit:
            cpu_limit = self.max_udf_cpu_limit
        if not (isinstance(sql_query, str) or all(isinstance(q, str) for q in sql_query)):
            raise PondError(f"sql_query must be a string or a list of strings: {sql_query!r}")
        super().__init__(ctx, input_deps, output_name, output_path, cpu_limit=cpu_limit, memory_limit=memory_limit)
        self.sql_queries = [sql_query] if isinstance(sql_query, str) else list(sql_query)
        self.udfs = [ctx.create_duckdb_extension(p) for p in extension_paths or []] + \
                    [ctx.create_external_module(p) for p in udf_module_paths or []]
        for u in udfs or []:
            if isinstance(u, UserDefinedFunction):
                name = ctx.create_function(u.name, u.func, u.params, u.return_type, u.use_arrow_type)
            elif isinstance(u, str) and u in ctx.udfs:
                name = u
            elif isinstance(u, str) and u.endswith(".duckdb_extension"):
                name = ctx.create_duckdb_extension(u)
            elif isinstance(u, str) and u.endswith(".so"):
                name = ctx.create_external_module(u)
            else:
                raise PondError(f"invalid udf: {u!r} (a @udf function, a .duckdb_extension or a registered name)")
            self.udfs.append(name)
        self.per_thread_output = per_thread_output
        self.materialize_output = materialize_output
        self.materialize_in_memory = materialize_in_memory
        self.batched_processing = batched_processing and len(input_deps) == 1
        self.enable_temp_directory = enable_temp_directory
        self.parquet_row_group_size = parquet_row_group_size or self.default_row_group_size
        self.parquet_dictionary_encoding = parquet_dictionary_encoding
        self.parquet_compression = parquet_compression
        self.parquet_compression_level = parquet_compression_level
        self.cpu_overcommit_ratio = cpu_overcommit_ratio
        self.memory_overcommit_ratio = memory_overcommit_ratio

    def __str__(self) -> str:
        return super().__str__() + f", sql_query=<{self.oneline_query[:100]}...>, udfs={self.udfs}"

    def describe(self) -> str:
        return f"{repr(self)} sql: {self.oneline_query[:200]}"

    @property
    def oneline_query(self) -> str:
        return "; ".join(" ".join(filter(None, map(str.strip, q.splitlines()))) for q in self.sql_queries)

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> SqlEngineTask:
        return self.spawn(runtime_ctx, input_deps, partition_infos, self.sql_queries,
                          udfs=[self.ctx.udfs[n] for n in self.udfs], per_thread_output=self.per_thread_output,
                          materialize_output=self.materialize_output,
                          parquet_row_group_size=self.parquet_row_group_size,
                          parquet_dictionary_encoding=self.parquet_dictionary_encoding,
                          parquet_compression=self.parquet_compression,
                          parquet_compression_level=self.parquet_compression_level, output_name=self.output_name,
                          output_path=self.output_path, cpu_limit=self.cpu_limit, gpu_limit=self.gpu_limit,
                          memory_limit=self.memory_limit, cpu_overcommit_ratio=self.cpu_overcommit_ratio,
                          memory_overcommit_ratio=self.memory_overcommit_ratio)

    def spawn(self, *args, **kwargs) -> SqlEngineTask:
        return SqlEngineTask(*args, **kwargs)

    @property
    def num_partitions(self) -> int:
        return _aligned_partitions(self)


def _aligned_partitions(node: Node) -> int:
    if not node.input_deps:
        return 1
    counts = {dep.num_partitions for dep in node.input_deps}
    if len(counts) > 1:
        raise PondError(f"{node!r}: its inputs have different numbers of partitions "
                        f"({', '.join(f'{d!r}: {d.num_partitions}' for d in node.input_deps)}); "
                        "repartition them to the same count (the same hash_by or range split points) first")
    return counts.pop()


class UnionNode(Node):
    """Union two or more nodes into one flow of data (partition-wise when counts agree)."""

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...]):
        super().__init__(ctx, input_deps)

    @property
    def num_partitions(self) -> int:
        counts = {d.num_partitions for d in self.input_deps}
        return counts.pop() if len(counts) == 1 else sum(d.num_partitions for d in self.input_deps)


class RootNode(Node):
    """A virtual node assembling several nodes; it outputs nothing."""

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...]):
        super().__init__(ctx, input_deps)

    @property
    def num_partitions(self) -> int:
        return 1


class ConsolidateNode(Node):
    """Merge partitions into larger ones without moving data (by the dimensions kept; only the top level
    dimension is supported: all partitions merge into one)."""

    def __init__(self, ctx: Context, input_dep: Node, dimensions: List[str]):
        super().__init__(ctx, [input_dep])
        self.dimensions = set(list(dimensions) + [PartitionInfo.toplevel_dimension])

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> MergeDataSetsTask:
        return MergeDataSetsTask(runtime_ctx, input_deps, partition_infos)

    @property
    def num_partitions(self) -> int:
        return 1


class PartitionNode(Node):
    """The base class of partition nodes: producers write, consumer i gathers the i-th piece of each."""

    max_num_producer_tasks = 100
    max_card_of_producers_x_consumers = 4_096_000

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], npartitions: int, dimension: str = None,
                 nested: bool = False, output_name: str = None, output_path: str = None, cpu_limit: int = 1,
                 memory_limit: Optional[int] = None) -> None:
        if not isinstance(npartitions, int) or isinstance(npartitions, bool) or npartitions < 1:
            raise PondError(f"npartitions must be a positive integer, got {npartitions!r}")
        if npartitions > MAX_PARTITIONS:
            raise PondError(f"npartitions {npartitions} exceeds the limit of {MAX_PARTITIONS}")
        if nested:
            raise PondError("nested partitions are not supported by pond; partition once with the final count")
        super().__init__(ctx, input_deps, output_name, output_path, cpu_limit, 0, memory_limit)
        self.npartitions = npartitions
        self.dimension = dimension if dimension is not None else PartitionInfo.default_dimension
        self.nested = nested

    def describe(self) -> str:
        return f"{repr(self)} npartitions={self.npartitions}"

    def create_producer_task(self, runtime_ctx, input_deps, partition_infos) -> Task:
        raise NotImplementedError

    def create_consumer_task(self, runtime_ctx, input_deps, partition_infos) -> PartitionConsumerTask:
        return PartitionConsumerTask(runtime_ctx, input_deps, partition_infos)

    def create_merge_task(self, runtime_ctx, input_deps, partition_infos) -> MergeDataSetsTask:
        return MergeDataSetsTask(runtime_ctx, input_deps, partition_infos)

    def create_split_task(self, runtime_ctx, input_deps, partition_infos) -> SplitDataSetTask:
        return SplitDataSetTask(runtime_ctx, input_deps, partition_infos)

    @property
    def num_partitions(self) -> int:
        return self.npartitions


class EvenlyDistributedPartitionNode(PartitionNode):
    """Distribute the files (or rows, with partition_by_rows) of input_deps evenly over n partitions."""

    max_num_producer_tasks = 1

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], npartitions: int, dimension: str = None,
                 nested: bool = False, *, partition_by_rows=False, random_shuffle=False, output_name: str = None,
                 output_path: str = None, cpu_limit: int = 1, memory_limit: Optional[int] = None) -> None:
        super().__init__(ctx, input_deps, npartitions, dimension, nested, output_name=output_name,
                         output_path=output_path, cpu_limit=cpu_limit, memory_limit=memory_limit)
        self.partition_by_rows = partition_by_rows and npartitions > 1
        self.random_shuffle = random_shuffle

    def describe(self) -> str:
        return f"{repr(self)} npartitions={self.npartitions} by_rows={self.partition_by_rows}"

    def create_producer_task(self, runtime_ctx, input_deps, partition_infos):
        return EvenlyDistributedPartitionProducerTask(runtime_ctx, input_deps, partition_infos, self.npartitions,
                                                      self.dimension, self.partition_by_rows, self.random_shuffle,
                                                      self.cpu_limit, self.memory_limit)


class HashPartitionNode(PartitionNode):
    """Partition by the hash of hash_columns; the output keeps the partition column (`__data_partition__`)."""

    default_cpu_limit = 1
    default_memory_limit = None
    default_data_partition_column = DATA_PARTITION_COLUMN_NAME
    default_engine_type = "duckdb"
    default_row_group_size = DEFAULT_ROW_GROUP_SIZE
    max_num_producer_tasks = 1000
    enable_resource_boost = True

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], npartitions: int, hash_columns: List[str] = None,
                 data_partition_column: str = None, *, dimension: str = None, nested: bool = False,
                 engine_type: Literal["duckdb", "arrow"] = None, random_shuffle: bool = False,
                 shuffle_only: bool = False, drop_partition_column: bool = False, use_parquet_writer: bool = False,
                 hive_partitioning: bool = False, parquet_row_group_size: int = None,
                 parquet_dictionary_encoding=False, parquet_compression="ZSTD", parquet_compression_level=3,
                 output_name: str = None, output_path: str = None, cpu_limit: Optional[int] = None,
                 memory_limit: Optional[int] = None) -> None:
        if random_shuffle and shuffle_only:
            raise PondError("random_shuffle and shuffle_only cannot be enabled at the same time")
        if shuffle_only and data_partition_column is None:
            raise PondError("data_partition_column not specified for shuffle-only partitioning")
        if not random_shuffle and not shuffle_only and not hash_columns:
            raise PondError("hash partitioning needs hash_columns (a column or a list of columns)")
        if engine_type not in (None, "duckdb", "arrow"):
            raise PondError(f"unknown query engine type: {engine_type!r}")
        self.partition_expr = data_partition_column if shuffle_only else None
        if data_partition_column is not None and not re.fullmatch("[a-zA-Z0-9_]+", data_partition_column):
            data_partition_column = None if shuffle_only else data_partition_column
        data_partition_column = data_partition_column or self.default_data_partition_column
        super().__init__(ctx, input_deps, npartitions, dimension or data_partition_column, nested, output_name,
                         output_path, cpu_limit or self.default_cpu_limit, memory_limit or self.default_memory_limit)
        self.hash_columns = ["random()"] if random_shuffle else hash_columns
        self.data_partition_column = data_partition_column
        self.engine_type = engine_type or self.default_engine_type
        self.random_shuffle = random_shuffle
        self.shuffle_only = shuffle_only
        self.drop_partition_column = drop_partition_column
        self.use_parquet_writer = use_parquet_writer
        self.hive_partitioning = hive_partitioning
        self.parquet_row_group_size = parquet_row_group_size or self.default_row_group_size
        self.parquet_dictionary_encoding = parquet_dictionary_encoding
        self.parquet_compression = parquet_compression
        self.parquet_compression_level = parquet_compression_level

    def describe(self) -> str:
        how = "random" if self.random_shuffle else (f"by {self.partition_expr}" if self.shuffle_only
                                                     else f"hash {self.hash_columns}")
        return f"{repr(self)} npartitions={self.npartitions} {how}"

    def create_producer_task(self, runtime_ctx, input_deps, partition_infos) -> HashPartitionTask:
        return HashPartitionTask(runtime_ctx, input_deps, partition_infos, self.npartitions, self.dimension,
                                 self.hash_columns, self.data_partition_column, self.random_shuffle, self.shuffle_only,
                                 self.drop_partition_column, self.use_parquet_writer, self.hive_partitioning,
                                 self.parquet_row_group_size, self.parquet_dictionary_encoding,
                                 self.parquet_compression, self.parquet_compression_level, self.output_name,
                                 self.output_path, self.cpu_limit, self.memory_limit,
                                 partition_expr=self.partition_expr)


class ShuffleNode(HashPartitionNode):
    """Partition by the value of data_partition_column (a column or an expression in [0, npartitions))."""

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], npartitions: int, data_partition_column: str = None,
                 *, dimension: str = None, nested: bool = False, engine_type=None, use_parquet_writer: bool = False,
                 hive_partitioning: bool = False, parquet_row_group_size: int = None, parquet_dictionary_encoding=False,
                 parquet_compression="ZSTD", parquet_compression_level=3, output_name: str = None,
                 output_path: str = None, cpu_limit: Optional[int] = None, memory_limit: Optional[int] = None) -> None:
        super().__init__(ctx, input_deps, npartitions, hash_columns=None, data_partition_column=data_partition_column,
                         dimension=dimension, nested=nested, engine_type=engine_type, random_shuffle=False,
                         shuffle_only=True, drop_partition_column=False, use_parquet_writer=use_parquet_writer,
                         hive_partitioning=hive_partitioning, parquet_row_group_size=parquet_row_group_size,
                         parquet_dictionary_encoding=parquet_dictionary_encoding,
                         parquet_compression=parquet_compression, parquet_compression_level=parquet_compression_level,
                         output_name=output_name, output_path=output_path, cpu_limit=cpu_limit,
                         memory_limit=memory_limit)


class RangePartitionNode(PartitionNode):
    """Partition by ranges of a key: partition i holds keys in [split_points[i-1], split_points[i]). Without
    split_points, pond samples the key (reservoir samples per producer) and picks npartitions-1 quantiles, so
    the partitions come out in key order: a partial sort per partition is then a global sort. Give the same
    split_points to two inputs to co-partition them for a join."""

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], split_points: Optional[List] = None,
                 dimension: str = None, nested: bool = False, output_name: str = None, output_path: str = None,
                 cpu_limit: int = 1, memory_limit: Optional[int] = None, *, npartitions: Optional[int] = None,
                 range_by: Optional[str] = None, samples_per_partition: int = 64,
                 drop_partition_column: bool = True) -> None:
        if range_by is None:
            raise PondError("RangePartitionNode needs range_by: the key column or expression")
        if split_points is not None:
            split_points = list(split_points)
            if any(a >= b for a, b in zip(split_points, split_points[1:])):
                raise PondError("split_points must be strictly increasing")
            n = len(split_points) + 1
        elif npartitions is None:
            raise PondError("RangePartitionNode needs split_points or npartitions")
        else:
            n = npartitions
        super().__init__(ctx, input_deps, n, dimension, nested, output_name, output_path, cpu_limit, memory_limit)
        self.split_points = split_points
        self.range_by = range_by
        self.samples_per_partition = samples_per_partition
        self.data_partition_column = DATA_PARTITION_COLUMN_NAME
        self.drop_partition_column = drop_partition_column

    def describe(self) -> str:
        src = "given split points" if self.split_points is not None else "sampled split points"
        return f"{repr(self)} npartitions={self.npartitions} range by {self.range_by} ({src})"

    def create_producer_task(self, runtime_ctx, input_deps, partition_infos) -> RangePartitionTask:
        return RangePartitionTask(runtime_ctx, input_deps, partition_infos, self.npartitions, self.dimension, None,
                                  self.data_partition_column, False, False, self.drop_partition_column,
                                  output_name=self.output_name, output_path=self.output_path,
                                  cpu_limit=self.cpu_limit, memory_limit=self.memory_limit, range_expr=self.range_by)

    def create_sample_task(self, runtime_ctx, input_deps, partition_infos, nproducers: int) -> SampleTask:
        rows = max(16, (self.samples_per_partition * self.npartitions + nproducers - 1) // nproducers)
        return SampleTask(runtime_ctx, input_deps, partition_infos, self.range_by, rows)

    def create_boundary_task(self, runtime_ctx, input_deps, partition_infos) -> SampleBoundaryTask:
        return SampleBoundaryTask(runtime_ctx, input_deps, partition_infos, self.npartitions)


class LoadPartitionedDataSetNode(PartitionNode):
    """Load a data set already partitioned by `data_partition_column` (files of a hash partition output)."""

    max_num_producer_tasks = 10

    def __init__(self, ctx: Context, input_deps: Tuple[Node, ...], npartitions: int, dimension: str = None,
                 nested: bool = False, data_partition_column: str = None, hive_partitioning: bool = False,
                 cpu_limit: int = 1, memory_limit: Optional[int] = None) -> None:
        if not (dimension or data_partition_column):
            raise PondError("Both 'dimension' and 'data_partition_column' are none or empty")
        super().__init__(ctx, input_deps, npartitions, dimension or data_partition_column, nested,
                         cpu_limit=cpu_limit, memory_limit=memory_limit)
        self.data_partition_column = data_partition_column
        self.hive_partitioning = hive_partitioning

    def create_producer_task(self, runtime_ctx, input_deps, partition_infos) -> HashPartitionTask:
        return HashPartitionTask(runtime_ctx, input_deps, partition_infos, self.npartitions, self.dimension, None,
                                 self.data_partition_column, shuffle_only=True,
                                 partition_expr=self.data_partition_column, cpu_limit=self.cpu_limit,
                                 memory_limit=self.memory_limit)


def DataSetPartitionNode(ctx: Context, input_deps: Tuple[Node, ...], npartitions: int, *, partition_by_rows=False,
                         random_shuffle=False, data_partition_column=None):
    """Partition the outputs of input_deps into n partitions (evenly, or by a stored partition column)."""
    if partition_by_rows and data_partition_column:
        raise PondError("partition_by_rows and data_partition_column cannot be set at the same time")
    if data_partition_column is None:
        node = EvenlyDistributedPartitionNode(ctx, input_deps, npartitions, partition_by_rows=partition_by_rows,
                                              random_shuffle=random_shuffle)
        return ConsolidateNode(ctx, node, dimensions=[]) if npartitions == 1 else node
    return LoadPartitionedDataSetNode(ctx, input_deps, npartitions, dimension=data_partition_column,
                                      data_partition_column=data_partition_column)


class ProjectionNode(Node):
    """Select columns (and generated columns: filename, file_row_number) of an input node."""

    def __init__(self, ctx: Context, input_dep: Node, columns: List[str] = None,
                 generated_columns: List[Literal["filename", "file_row_number"]] = None, union_by_name=None) -> None:
        columns = columns or ["*"]
        generated_columns = generated_columns or []
        if not all(c in GENERATED_COLUMNS for c in generated_columns):
            raise PondError(f"invalid values found in generated columns: {generated_columns}")
        super().__init__(ctx, [input_dep])
        self.columns = columns
        self.generated_columns = generated_columns
        self.union_by_name = union_by_name

    def create_task(self, runtime_ctx, input_deps, partition_infos) -> ProjectionTask:
        return ProjectionTask(runtime_ctx, input_deps, partition_infos, self.columns, self.generated_columns,
                              self.union_by_name)

    @property
    def num_partitions(self) -> int:
        return self.input_deps[0].num_partitions


class LimitNode(SqlEngineNode):
    """At most `limit` rows: a limit per partition, a merge, and a final limit (one partition)."""

    def __init__(self, ctx: Context, input_dep: Node, limit: int) -> None:
        if not isinstance(limit, int) or limit < 0:
            raise PondError(f"limit must be a non-negative integer, got {limit!r}")
        super().__init__(ctx, (input_dep,), f"select * from {{0}} limit {limit}")
        self.limit = limit

    def create_merge_task(self, runtime_ctx, input_deps, partition_infos) -> MergeDataSetsTask:
        return MergeDataSetsTask(runtime_ctx, input_deps, partition_infos)

    @property
    def num_partitions(self) -> int:
        return 1


T = TypeVar("T")


class LogicalPlanVisitor(Generic[T]):
    """Visit the nodes of a logical plan depth first, dispatching on the node type."""

    def visit(self, node: Node, depth: int = 0) -> T:
        for cls, name in _VISIT_ORDER:
            if isinstance(node, cls):
                return getattr(self, name)(node, depth)
        raise PondError(f"Unknown node type: {node}")

    def generic_visit(self, node: Node, depth: int) -> T:
        for dep in node.input_deps:
            self.visit(dep, depth + 1)

    def visit_data_source_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_data_sink_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_root_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_union_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_consolidate_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_partition_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_python_script_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_arrow_compute_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_arrow_stream_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_query_engine_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_projection_node(self, node, depth): return self.generic_visit(node, depth)
    def visit_limit_node(self, node, depth): return self.generic_visit(node, depth)


_VISIT_ORDER = [(DataSourceNode, "visit_data_source_node"), (DataSinkNode, "visit_data_sink_node"),
                (RootNode, "visit_root_node"), (UnionNode, "visit_union_node"),
                (ConsolidateNode, "visit_consolidate_node"), (PartitionNode, "visit_partition_node"),
                (PythonScriptNode, "visit_python_script_node"), (ArrowComputeNode, "visit_arrow_compute_node"),
                (ArrowStreamNode, "visit_arrow_stream_node"), (LimitNode, "visit_limit_node"),
                (SqlEngineNode, "visit_query_engine_node"), (ProjectionNode, "visit_projection_node")]


class LogicalPlan:
    """The logical plan: a DAG of nodes below root_node."""

    def __init__(self, ctx: Context, root_node: Node) -> None:
        self.ctx = ctx
        self.root_node = root_node

    def __str__(self) -> str:
        return self.explain_str()

    def explain_str(self) -> str:
        visited = set()

        def lines(node: Node, depth: int) -> List[str]:
            out = ["  " * depth + node.describe() + f"  [{node.location}]"]
            if node.id in visited:
                return out + ["  " * depth + "  (shown above)"]
            visited.add(node.id)
            for dep in node.input_deps:
                out.extend(lines(dep, depth + 1))
            return out

        return os.linesep.join(lines(self.root_node, 0))

    @property
    def nodes(self) -> Dict[NodeId, Node]:
        nodes: Dict[NodeId, Node] = {}

        def collect(node: Node):
            if node.id in nodes:
                return
            nodes[node.id] = node
            for dep in node.input_deps:
                collect(dep)

        collect(self.root_node)
        return nodes

    def graph(self):
        """A graphviz Digraph when graphviz is installed (optional; pond never needs it)."""
        from graphviz import Digraph
        dot = Digraph(comment="pond")
        for node in self.nodes.values():
            dot.node(str(node.id), repr(node))
            for dep in node.input_deps:
                dot.edge(str(dep.id), str(node.id))
        return dot
