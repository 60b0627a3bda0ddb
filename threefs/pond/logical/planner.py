"""Planner: logical nodes → tasks (names follow smallpond.logical.planner).

Fan-out: a partition node gets one producer per input partition; a single input partition made of many files
is first split by files into up to `2 × CPUs` producers, so one big read does not run on one core. Consumer i
of a partition node is an inline task gathering the i-th output of every producer (the shuffle goes through
the file system: producers write one file set per partition, consumers only name them).
"""

from __future__ import annotations

from typing import Dict, List, Optional

from threefs.pond.common import PondError
from threefs.pond.execution.task import (ArrowTableDataSet, DataSourceTask, MergeDataSetsTask, PartitionInfo,
                                         RuntimeContext, SplitDataSetTask, Task)
from threefs.pond.logical.dataset import DataSet, ParquetDataSet
from threefs.pond.logical.node import (ArrowComputeNode, ArrowStreamNode, ConsolidateNode, DataSinkNode,
                                       DataSourceNode, EvenlyDistributedPartitionNode, LimitNode, LogicalPlan,
                                       LogicalPlanVisitor, Node, PartitionNode, ProjectionNode, PythonScriptNode,
                                       RangePartitionNode, RootNode, SqlEngineNode, UnionNode)


class ComputedNode(DataSourceNode):
    """A node whose partitions are already computed (a DataFrame computed earlier in the session)."""

    def __init__(self, ctx, origin: Node, datasets: List[DataSet]) -> None:
        super().__init__(ctx, None)
        self.id = origin.id  # keeps the identity: outputs recorded under it stay valid
        self.origin = origin
        self.datasets = list(datasets)

    def describe(self) -> str:
        return f"{self.origin.describe()} (computed: {len(self.datasets)} partitions)"

    @property
    def num_partitions(self) -> int:
        return len(self.datasets)


class RootTask(Task):
    inline = True

    def run_inline(self, input_datasets):
        return ParquetDataSet([])


class ExecutionPlan:
    """The tasks of a logical plan, below one root task."""

    def __init__(self, runtime_ctx: RuntimeContext, root_task: Task, logical_plan: LogicalPlan) -> None:
        self.runtime_ctx = runtime_ctx
        self.root_task = root_task
        self.logical_plan = logical_plan

    @property
    def tasks(self) -> Dict[str, Task]:
        out: Dict[str, Task] = {}

        def walk(t: Task):
            if t.key in out:
                return
            for d in t.input_deps:
                walk(d)
            out[t.key] = t

        walk(self.root_task)
        return out

    def __str__(self) -> str:
        return f"ExecutionPlan: {len(self.tasks)} tasks, root={self.root_task.key}"


class Planner(LogicalPlanVisitor[List[Task]]):
    """Create the tasks of each node (one per output partition), memoized per node."""

    def __init__(self, runtime_ctx: RuntimeContext, max_producers: Optional[int] = None) -> None:
        self.runtime_ctx = runtime_ctx
        self.node_to_tasks: Dict[int, List[Task]] = {}
        self.counters: Dict[int, int] = {}
        self.max_producers = max_producers or max(2, 2 * runtime_ctx.usable_cpu_count)

    def create_exec_plan(self, logical_plan: LogicalPlan) -> ExecutionPlan:
        tasks = self.visit(logical_plan.root_node)
        root = RootTask(self.runtime_ctx, tasks, [PartitionInfo()])
        root.node_id, root.index = 0, 0
        root.finalize_identity()
        return ExecutionPlan(self.runtime_ctx, root, logical_plan)

    def visit(self, node: Node, depth: int = 0) -> List[Task]:
        if node.id not in self.node_to_tasks:
            self.node_to_tasks[node.id] = super().visit(node, depth)
        return self.node_to_tasks[node.id]

    def _new(self, node: Node, task: Task) -> Task:
        index = self.counters.get(node.id, 0)
        self.counters[node.id] = index + 1
        node._stamp(task, index)
        task.finalize_identity()
        return task

    # -- nodes ------------------------------------------------------------------------------------
    def visit_data_source_node(self, node: DataSourceNode, depth: int) -> List[Task]:
        if isinstance(node, ComputedNode):
            n = len(node.datasets)
            return [self._new(node, DataSourceTask(self.runtime_ctx, ds, [PartitionInfo(i, n)]))
                    for i, ds in enumerate(node.datasets)]
        return [self._new(node, node.create_task(self.runtime_ctx, [], [PartitionInfo()]))]

    def visit_data_sink_node(self, node: DataSinkNode, depth: int) -> List[Task]:
        inputs = [t for dep in node.input_deps for t in self.visit(dep, depth + 1)]
        return [self._new(node, node.create_task(self.runtime_ctx, inputs, [PartitionInfo()]))]

    def visit_root_node(self, node: RootNode, depth: int) -> List[Task]:
        inputs = [t for dep in node.input_deps for t in self.visit(dep, depth + 1)]
        return [self._new(node, RootTask(self.runtime_ctx, inputs, [PartitionInfo()]))]

    def visit_union_node(self, node: UnionNode, depth: int) -> List[Task]:
        per_dep = [self.visit(dep, depth + 1) for dep in node.input_deps]
        if len({len(ts) for ts in per_dep}) == 1:
            n = len(per_dep[0])
            return [self._new(node, MergeDataSetsTask(self.runtime_ctx, [ts[i] for ts in per_dep], [PartitionInfo(i, n)]))
                    for i in range(n)]
        flat = [t for ts in per_dep for t in ts]
        return [self._new(node, MergeDataSetsTask(self.runtime_ctx, [t], [PartitionInfo(i, len(flat))]))
                for i, t in enumerate(flat)]

    def visit_consolidate_node(self, node: ConsolidateNode, depth: int) -> List[Task]:
        inputs = self.visit(node.input_deps[0], depth + 1)
        return [self._new(node, node.create_task(self.runtime_ctx, inputs, [PartitionInfo()]))]

    def visit_partition_node(self, node: PartitionNode, depth: int) -> List[Task]:
        inputs = [t for dep in node.input_deps for t in self.visit(dep, depth + 1)]
        n = node.npartitions
        if isinstance(node, EvenlyDistributedPartitionNode):
            producer = self._new(node, node.create_producer_task(self.runtime_ctx, inputs, [PartitionInfo()]))
            producers = [producer]
        else:
            pieces = self._producer_inputs(node, inputs)
            if isinstance(node, RangePartitionNode):
                bounds = self._bounds_task(node, pieces)
                producers = [self._new(node, node.create_producer_task(self.runtime_ctx, [p, bounds],
                                                                       [PartitionInfo(i, len(pieces))]))
                             for i, p in enumerate(pieces)]
            else:
                producers = [self._new(node, node.create_producer_task(self.runtime_ctx, [p],
                                                                       [PartitionInfo(i, len(pieces))]))
                             for i, p in enumerate(pieces)]
        return [self._new(node, node.create_consumer_task(self.runtime_ctx, producers,
                                                          [PartitionInfo(i, n, node.dimension)]))
                for i in range(n)]

    def _producer_inputs(self, node: PartitionNode, inputs: List[Task]) -> List[Task]:
        """One producer per input partition; a single many-file source is split by files first."""
        if len(inputs) == 1 and isinstance(inputs[0], DataSourceTask) and isinstance(inputs[0].dataset, ParquetDataSet) \
                and inputs[0].dataset.row_ranges is None:
            nfiles = inputs[0].dataset.num_files
            k = min(nfiles, self.max_producers, node.max_num_producer_tasks)
            if k > 1:
                return [self._new(node, SplitDataSetTask(self.runtime_ctx, inputs, [PartitionInfo(i, k)]))
                        for i in range(k)]
        return inputs

    def _bounds_task(self, node: RangePartitionNode, pieces: List[Task]) -> Task:
        if node.split_points is not None:
            import pyarrow as pa
            table = pa.table({"bound": pa.array(node.split_points)})
            return self._new(node, DataSourceTask(self.runtime_ctx, ArrowTableDataSet(table), [PartitionInfo()]))
        samples = [self._new(node, node.create_sample_task(self.runtime_ctx, [p], [PartitionInfo(i, len(pieces))],
                                                           len(pieces)))
                   for i, p in enumerate(pieces)]
        return self._new(node, node.create_boundary_task(self.runtime_ctx, samples, [PartitionInfo()]))

    def _per_partition(self, node: Node, depth: int) -> List[Task]:
        per_dep = [self.visit(dep, depth + 1) for dep in node.input_deps]
        if not per_dep:
            return [self._new(node, node.create_task(self.runtime_ctx, [], [PartitionInfo()]))]
        counts = {len(ts) for ts in per_dep}
        if len(counts) > 1:
            raise PondError(f"{node!r}: its inputs have different numbers of partitions "
                            f"({', '.join(f'{d!r}: {len(ts)}' for d, ts in zip(node.input_deps, per_dep))}); "
                            "repartition them to the same count (the same hash_by, or the same range split points) first")
        n = counts.pop()
        return [self._new(node, node.create_task(self.runtime_ctx, [ts[i] for ts in per_dep], [PartitionInfo(i, n)]))
                for i in range(n)]

    def visit_python_script_node(self, node: PythonScriptNode, depth: int) -> List[Task]:
        return self._per_partition(node, depth)

    def visit_arrow_compute_node(self, node: ArrowComputeNode, depth: int) -> List[Task]:
        return self._per_partition(node, depth)

    def visit_arrow_stream_node(self, node: ArrowStreamNode, depth: int) -> List[Task]:
        return self._per_partition(node, depth)

    def visit_query_engine_node(self, node: SqlEngineNode, depth: int) -> List[Task]:
        return self._per_partition(node, depth)

    def visit_projection_node(self, node: ProjectionNode, depth: int) -> List[Task]:
        return self._per_partition(node, depth)

    def visit_limit_node(self, node: LimitNode, depth: int) -> List[Task]:
        partial = self._per_partition(node, depth)
        if len(partial) == 1:
            return partial
        merged = self._new(node, node.create_merge_task(self.runtime_ctx, partial, [PartitionInfo()]))
        return [self._new(node, node.create_task(self.runtime_ctx, [merged], [PartitionInfo()]))]
