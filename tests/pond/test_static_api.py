"""The static API (Context, LogicalPlan, nodes, Planner, Driver) under smallpond's module paths."""

from __future__ import annotations

import os
import sys

import pyarrow as pa

from threefs.pond.execution.driver import Driver
from threefs.pond.execution.task import RuntimeContext
from threefs.pond.logical.dataset import ParquetDataSet
from threefs.pond.logical.node import (ArrowComputeNode, Context, DataSinkNode, DataSourceNode, HashPartitionNode,
                                       LogicalPlan, SqlEngineNode)
from threefs.pond.logical.planner import Planner

from pond_helpers import multiset, reference


def plan(ctx: Context, data_dir: str, out: str) -> LogicalPlan:
    src = DataSourceNode(ctx, ParquetDataSet([f"{data_dir}/*.parquet"]))
    parts = HashPartitionNode(ctx, (src,), npartitions=3, hash_columns=["k"])
    agg = SqlEngineNode(ctx, (parts,), "select k, count(*) as n from {0} group by k")
    tagged = ArrowComputeNode(ctx, (agg,), process_func=lambda rc, ts: ts[0].append_column(
        "p", pa.array([rc.task.partition_index] * ts[0].num_rows)))
    return LogicalPlan(ctx, DataSinkNode(ctx, (tagged,), out))


def test_planner_makes_tasks(data_dir, tmp_path):
    from datetime import datetime
    rc = RuntimeContext("static", datetime.now(), str(tmp_path), usable_cpu_count=2)
    exec_plan = Planner(rc).create_exec_plan(plan(Context(), data_dir, str(tmp_path / "out")))
    kinds = sorted({type(t).__name__ for t in exec_plan.tasks.values()})
    assert {"HashPartitionTask", "SqlEngineTask", "ArrowComputeTask", "DataSinkTask"} <= set(kinds)


def test_driver_runs_a_plan(data_dir, tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    monkeypatch.setattr(sys, "argv", ["prog", "--data_root", str(tmp_path / "root"), "--num_executors", "2",
                                      "--max_retry", "2"])
    driver = Driver()
    assert driver.get_arguments().num_executors == 2
    driver.run(plan(Context(), data_dir, out))
    import duckdb
    rows = duckdb.sql(f"select k, n from read_parquet('{out}/*.parquet')").fetchall()
    assert multiset(rows) == reference(data_dir, "select k, count(*) from {0} group by k")
    assert os.path.exists(os.path.join(out, ".MANIFEST.txt"))
