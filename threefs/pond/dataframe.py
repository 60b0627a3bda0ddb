"""The dynamic API: Session and DataFrame (names, arguments and semantics of smallpond 0.15's dataframe).

Differences, all fixes: runs without Ray (a local process pool) or on Ray; explicit init() arguments win
over SP_* variables; a DataFrame computed once (also through write_parquet) is not recomputed by a later
to_pandas()/count(); range partitioning (repartition(n, range_by=...)); explain() and an HTML timeline.
"""

from __future__ import annotations

import html
import os
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Union

import pandas as pd
import pyarrow as arrow

from threefs.pond.common import PondError
from threefs.pond.execution.task import DataSourceTask, Task  # noqa: F401 (smallpond.dataframe exposes them)
from threefs.pond.logical.dataset import (ArrowTableDataSet, CsvDataSet, DataSet, JsonDataSet, PandasDataSet,
                                          ParquetDataSet, PartitionedDataSet, large_strings)  # noqa: F401
from threefs.pond.logical.node import (ArrowBatchNode, ArrowStreamNode, DataSinkNode, DataSourceNode,
                                       EvenlyDistributedPartitionNode, HashPartitionNode, LimitNode, LogicalPlan, Node,
                                       RangePartitionNode, ShuffleNode, SqlEngineNode)
from threefs.pond.logical.optimizer import Optimizer
from threefs.pond.logical.planner import ExecutionPlan, Planner  # noqa: F401
from threefs.pond.session import SessionBase


class Session(SessionBase):
    """Creates DataFrames and runs them. Get one with `threefs.pond.init(...)`."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._nodes: List[Node] = []
        self._node_outputs: Dict[int, List[DataSet]] = {}

    # -- sources ------------------------------------------------------------------------------------
    def read_csv(self, paths: Union[str, List[str]], schema: Dict[str, str], delim=",") -> "DataFrame":
        return DataFrame(self, DataSourceNode(self._ctx, CsvDataSet(paths, OrderedDict(schema), delim)))

    def read_parquet(self, paths: Union[str, List[str]], recursive: bool = False, columns: Optional[List[str]] = None,
                     union_by_name: bool = False) -> "DataFrame":
        ds = ParquetDataSet(paths, columns=columns, union_by_name=union_by_name, recursive=recursive)
        return DataFrame(self, DataSourceNode(self._ctx, ds))

    def read_json(self, paths: Union[str, List[str]], schema: Dict[str, str]) -> "DataFrame":
        return DataFrame(self, DataSourceNode(self._ctx, JsonDataSet(paths, schema)))

    def from_items(self, items: List[Any]) -> "DataFrame":
        if not isinstance(items, list):
            raise PondError("items must be a list")
        if not items:
            raise PondError("items must not be empty")
        if isinstance(items[0], dict):
            return self.from_arrow(arrow.Table.from_pylist(items))
        return self.from_arrow(arrow.table({"item": items}))

    def from_pandas(self, df: pd.DataFrame) -> "DataFrame":
        return DataFrame(self, DataSourceNode(self._ctx, PandasDataSet(df)))

    def from_arrow(self, table: arrow.Table) -> "DataFrame":
        return DataFrame(self, DataSourceNode(self._ctx, ArrowTableDataSet(table)))

    def partial_sql(self, query: str, *inputs: "DataFrame", **kwargs) -> "DataFrame":
        """Run `query` on each partition of the inputs ({0}, {1}, ... name them; all inputs need the same number
        of partitions)."""
        plan = SqlEngineNode(self._ctx, tuple(i.plan for i in inputs), query, **kwargs)
        return DataFrame(self, plan, recompute=any(i.need_recompute for i in inputs))

    # -- running ------------------------------------------------------------------------------------
    def wait(self, *dfs: "DataFrame") -> None:
        for df in dfs:
            df.compute()

    def _run(self, df: "DataFrame") -> List[DataSet]:
        plan = df._optimized()
        planner = Planner(self._runtime_ctx)
        tasks = planner.visit(plan)
        if df.need_recompute:
            ids = set(getattr(plan, "fused_from", [plan.id])) | {plan.id}
            prefixes = tuple(f"-{i:06d}." for i in ids)
            self._scheduler.forget(lambda key: any(p in key for p in prefixes))
        try:
            outputs = self._scheduler.run(tasks)
        except BaseException:
            self._failed = True
            raise
        self._node_outputs[df.plan.id] = outputs
        return outputs

    def graph(self):
        from graphviz import Digraph
        dot = Digraph(comment="pond")
        for node in self._nodes:
            dot.node(str(node.id), repr(node))
            for dep in node.input_deps:
                dot.edge(str(dep.id), str(node.id))
        return dot

    def dump_graph(self, path: Optional[str] = None) -> str:
        text = "\n".join(f"{n!r} <- {[repr(d) for d in n.input_deps]}" for n in self._nodes)
        if path:
            with open(path, "w") as f:
                f.write(text)
        return text

    def dump_timeline(self, path: Optional[str] = None) -> str:
        """An HTML timeline of every task attempt of this session (one bar per task, a lane per worker)."""
        path = path or os.path.join(self._runtime_ctx.log_root, "timeline.html")
        recs = [r for r in self._scheduler.stats.records if r.finished]
        t0 = min((r.submitted for r in recs), default=time.time())
        t1 = max((r.finished for r in recs), default=t0 + 1)
        span = max(t1 - t0, 1e-3)
        lanes = sorted({r.worker for r in recs})
        colors = {"ok": "#4c9f70", "failed": "#d1495b", "lost": "#edae49", "running": "#999"}
        rows = []
        for r in recs:
            start = r.started or r.submitted
            left = 100 * (start - t0) / span
            width = max(0.2, 100 * (r.finished - start) / span)
            lane = lanes.index(r.worker)
            rows.append(f'<div class="bar" title="{html.escape(r.key)} attempt {r.attempt} {r.status} '
                        f'{r.finished - start:.3f}s worker {html.escape(r.worker)}" style="left:{left:.2f}%;'
                        f'width:{width:.2f}%;top:{lane * 22}px;background:{colors.get(r.status, "#999")}"></div>')
        doc = ("<!doctype html><meta charset=utf-8><title>pond timeline</title><style>"
               ".lane{position:relative;height:" + str(22 * max(1, len(lanes))) + "px;border:1px solid #ccc}"
               ".bar{position:absolute;height:18px;opacity:.85}</style>"
               f"<h3>pond job {html.escape(self._runtime_ctx.job_id)}: {len(recs)} task attempts, "
               f"{span:.2f} s, workers {', '.join(map(html.escape, lanes))}</h3>"
               f"<div class=lane>{''.join(rows)}</div>")
        with open(path, "w") as f:
            f.write(doc)
        return path


class DataFrame:
    """A lazy, partitioned data set: every method returns a new DataFrame; actions (count, take, to_pandas,
    write_parquet, compute) run the plan."""

    def __init__(self, session: Session, plan: Node, recompute: bool = False) -> None:
        self.session = session
        self.plan = plan
        self.optimized_plan: Optional[Node] = None
        self.need_recompute = recompute
        session._nodes.append(plan)

    def __str__(self) -> str:
        return repr(self.plan)

    # -- planning -----------------------------------------------------------------------------------
    def _optimized(self) -> Node:
        computed = dict(self.session._node_outputs)
        if self.need_recompute:
            computed.pop(self.plan.id, None)
        return Optimizer(computed=computed).visit(self.plan)

    def explain(self) -> str:
        """The optimized plan (fused SQL shown as one node) and how many tasks each node becomes."""
        plan = self._optimized()
        planner = Planner(self.session._runtime_ctx)
        planner.visit(plan)
        counts = planner.counters
        lines = LogicalPlan(self.session._ctx, plan).explain_str().splitlines()
        out = []
        for line, node in zip(lines, _walk(plan)):
            out.append(f"{line}  -> {counts.get(node.id, 0)} tasks" if node is not None else line)
        return "\n".join(out)

    def is_computed(self) -> bool:
        return self.plan.id in self.session._node_outputs

    def compute(self) -> None:
        self._compute()

    def _compute(self) -> List[DataSet]:
        if self.is_computed() and not self.need_recompute:
            return self.session._node_outputs[self.plan.id]
        outputs = self.session._run(self)
        self.need_recompute = False
        return outputs

    def recompute(self) -> "DataFrame":
        self.need_recompute = True
        return self

    def _new(self, plan: Node) -> "DataFrame":
        return DataFrame(self.session, plan, recompute=self.need_recompute)

    # -- transformations ----------------------------------------------------------------------------
    def repartition(self, npartitions: int, hash_by: Union[str, List[str], None] = None, by: Optional[str] = None,
                    by_rows: bool = False, *, range_by: Optional[str] = None, split_points: Optional[list] = None,
                    **kwargs) -> "DataFrame":
        """Repartition into npartitions: evenly by files (default) or rows (by_rows), by the hash of columns
        (hash_by; the output keeps `__data_partition__`), by the value of an expression in [0, n) (by), or by
        key ranges (range_by, pond only: sampled split points unless split_points is given)."""
        chosen = [x is not None for x in (hash_by, by, range_by)]
        if sum(chosen) > 1:
            raise PondError("cannot specify more than one of by, hash_by and range_by")
        ctx = self.session._ctx
        if by is not None:
            plan = ShuffleNode(ctx, (self.plan,), npartitions, data_partition_column=by, **kwargs)
        elif hash_by is not None:
            cols = [hash_by] if isinstance(hash_by, str) else list(hash_by)
            plan = HashPartitionNode(ctx, (self.plan,), npartitions, cols, **kwargs)
        elif range_by is not None:
            if split_points is not None and len(split_points) + 1 != npartitions:
                raise PondError(f"{len(split_points)} split points make {len(split_points) + 1} partitions, "
                                f"not {npartitions}")
            plan = RangePartitionNode(ctx, (self.plan,), split_points, npartitions=npartitions, range_by=range_by,
                                      **kwargs)
        else:
            plan = EvenlyDistributedPartitionNode(ctx, (self.plan,), npartitions, partition_by_rows=by_rows, **kwargs)
        return self._new(plan)

    def random_shuffle(self, **kwargs) -> "DataFrame":
        """Shuffle all rows globally (random partition, then random order in each)."""
        ctx = self.session._ctx
        part = HashPartitionNode(ctx, (self.plan,), self.plan.num_partitions, random_shuffle=True,
                                 drop_partition_column=True, **kwargs)
        plan = SqlEngineNode(ctx, (part,), r"select * from {0} order by random()", per_thread_output=False, **kwargs)
        return self._new(plan)

    def partial_sort(self, by: Union[str, List[str]], **kwargs) -> "DataFrame":
        """Sort the rows of each partition by the columns (`'a'`, `['a', 'b desc']`)."""
        by = [by] if isinstance(by, str) else list(by)
        kwargs.setdefault("per_thread_output", False)
        plan = SqlEngineNode(self.session._ctx, (self.plan,), f"select * from {{0}} order by {', '.join(by)}", **kwargs)
        return self._new(plan)

    def sort(self, by: str, npartitions: Optional[int] = None, **kwargs) -> "DataFrame":
        """A global sort (pond only): range partitioning on a sampled key, then a sort of each partition;
        reading the partitions in order gives all rows in order of `by`."""
        n = npartitions or max(1, self.plan.num_partitions)
        return self.repartition(n, range_by=by).partial_sort(by, **kwargs)

    def filter(self, sql_or_func: Union[str, Callable[[Dict[str, Any]], bool]], **kwargs) -> "DataFrame":
        """Keep the rows satisfying a SQL predicate (preferred) or a Python function of the row."""
        if isinstance(sql := sql_or_func, str):
            plan = SqlEngineNode(self.session._ctx, (self.plan,), f"select * from {{0}} where ({sql})", **kwargs)
        elif callable(func := sql_or_func):
            def process_func(_runtime_ctx, tables: List[arrow.Table]) -> arrow.Table:
                table = tables[0]
                return table.filter(arrow.array([bool(func(row)) for row in table.to_pylist()], type=arrow.bool_()))
            plan = ArrowBatchNode(self.session._ctx, (self.plan,), process_func=process_func, **kwargs)
        else:
            raise PondError("condition must be a SQL expression or a predicate function")
        return self._new(plan)

    def map(self, sql_or_func: Union[str, Callable[[Dict[str, Any]], Dict[str, Any]]], *,
            schema: Optional[arrow.Schema] = None, **kwargs) -> "DataFrame":
        """Apply a SQL select list (`'a + b as c'`) or a Python function of the row (returning a dict)."""
        if isinstance(sql := sql_or_func, str):
            plan = SqlEngineNode(self.session._ctx, (self.plan,), f"select {sql} from {{0}}", **kwargs)
        elif callable(func := sql_or_func):
            def process_func(_runtime_ctx, tables: List[arrow.Table]) -> arrow.Table:
                return arrow.Table.from_pylist([func(row) for row in tables[0].to_pylist()], schema=schema)
            plan = ArrowBatchNode(self.session._ctx, (self.plan,), process_func=process_func, **kwargs)
        else:
            raise PondError(f"must be a SQL expression or a function: {sql_or_func!r}")
        return self._new(plan)

    def flat_map(self, sql_or_func: Union[str, Callable[[Dict[str, Any]], List[Dict[str, Any]]]], *,
                 schema: Optional[arrow.Schema] = None, **kwargs) -> "DataFrame":
        """Apply a SQL select list producing several rows per row (`unnest(...)`) or a function returning a
        list of dicts."""
        if isinstance(sql := sql_or_func, str):
            plan = SqlEngineNode(self.session._ctx, (self.plan,), f"select {sql} from {{0}}", **kwargs)
        elif callable(func := sql_or_func):
            def process_func(_runtime_ctx, tables: List[arrow.Table]) -> arrow.Table:
                rows = [item for row in tables[0].to_pylist() for item in func(row)]
                return arrow.Table.from_pylist(rows, schema=schema)
            plan = ArrowBatchNode(self.session._ctx, (self.plan,), process_func=process_func, **kwargs)
        else:
            raise PondError(f"must be a SQL expression or a function: {sql_or_func!r}")
        return self._new(plan)

    def map_batches(self, func: Callable[[arrow.Table], arrow.Table], *, batch_size: int = 122880,
                    streaming: bool = False, **kwargs) -> "DataFrame":
        """Apply func to Arrow tables of batch_size rows (streaming: func maps an iterator of tables to an
        iterator of tables)."""
        if streaming:
            def process_func(_runtime_ctx, readers):
                return func(arrow.Table.from_batches([b]) for b in readers[0])
            plan = ArrowStreamNode(self.session._ctx, (self.plan,), process_func=process_func,
                                   streaming_batch_size=batch_size, **kwargs)
        else:
            def process_func(_runtime_ctx, tables: List[arrow.Table]) -> arrow.Table:
                return func(tables[0])
            plan = ArrowBatchNode(self.session._ctx, (self.plan,), process_func=process_func,
                                  streaming_batch_size=batch_size, **kwargs)
        return self._new(plan)

    def limit(self, limit: int) -> "DataFrame":
        """At most `limit` rows (lazy; take() runs it)."""
        return self._new(LimitNode(self.session._ctx, self.plan, limit))

    def write_parquet(self, path: str) -> None:
        """Write the partitions under path (hard links to the task files plus `.MANIFEST.txt`). The result
        stays known to the session: a later to_pandas() reads it instead of recomputing."""
        self.write_parquet_lazy(path).compute()

    def write_parquet_lazy(self, path: str) -> "DataFrame":
        target = path if path.startswith("threefs://") else os.path.abspath(path)
        sink = DataFrame(self.session, DataSinkNode(self.session._ctx, (self.plan,), target, type="link_or_copy"),
                         recompute=self.need_recompute)
        sink._source = self
        return _SinkFrame(sink, self)

    # -- actions --------------------------------------------------------------------------------------
    def count(self) -> int:
        """Number of rows (from Parquet metadata when the data is a plain read)."""
        if isinstance(self.plan, DataSourceNode) and not self.is_computed():
            return self.plan.dataset.num_rows
        return sum(ds.num_rows for ds in self._compute())

    def take(self, limit: int) -> List[Dict[str, Any]]:
        if self.is_computed() or isinstance(self.plan, DataSourceNode):
            datasets = self._compute()
        else:
            datasets = self.limit(limit)._compute()
        rows: List[Dict[str, Any]] = []
        for ds in datasets:
            for batch in ds.to_batch_reader():
                rows.extend(batch.to_pylist())
                if len(rows) >= limit:
                    return rows[:limit]
        return rows

    def take_all(self) -> List[Dict[str, Any]]:
        rows: List[Dict[str, Any]] = []
        for ds in self._compute():
            for batch in ds.to_batch_reader():
                rows.extend(batch.to_pylist())
        return rows

    def to_pandas(self) -> pd.DataFrame:
        datasets = self._compute()
        frames = [ds.to_pandas() for ds in datasets]
        if len(frames) == 1:
            return frames[0]
        return pd.concat(frames, ignore_index=True)

    def to_arrow(self) -> arrow.Table:
        tables = [ds.to_arrow_table() for ds in self._compute()]
        tables = [t for t in tables if t.num_columns > 0] or tables
        if len(tables) == 1:
            return tables[0]
        return arrow.concat_tables([large_strings(t) for t in tables], promote_options="default")


class _SinkFrame(DataFrame):
    """The DataFrame of write_parquet_lazy: computing it also records the written files as the result of the
    DataFrame that was written, so reading that one later does not recompute it."""

    def __init__(self, sink: DataFrame, source: DataFrame) -> None:
        self.__dict__.update(sink.__dict__)
        self._source = source

    def _compute(self) -> List[DataSet]:
        outputs = super()._compute()
        src = self._source
        if not src.is_computed():
            parts = self.session._node_outputs.get(src.plan.id)
            if parts is None:
                # the sink's input tasks ran as part of this job: take their outputs
                plan = src._optimized()
                tasks = Planner(self.session._runtime_ctx).visit(plan)
                done = self.session._scheduler.done
                if all(t.key in done for t in tasks):
                    self.session._node_outputs[src.plan.id] = [done[t.key] for t in tasks]
        return outputs


def _walk(node: Node):
    seen = set()

    def rec(n: Node):
        yield n
        if n.id in seen:
            yield None
            return
        seen.add(n.id)
        for d in n.input_deps:
            yield from rec(d)

    return list(rec(node))
