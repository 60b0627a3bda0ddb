"""Driver: the command-line entry point of static (LogicalPlan) programs, with smallpond's main flags.

    driver = Driver()
    driver.add_argument("-i", "--input_paths", nargs="+")     # the program's own flags
    args = driver.get_arguments()
    driver.run(LogicalPlan(ctx, root))

Modes: `scheduler` (default: the local process pool), `ray` (Ray; --ray_address or a loopback instance).
smallpond's `executor` mode (separate executor processes polling a file-system queue) does not exist in pond:
the local pool or Ray take its place, and saying so beats running nothing.
"""

from __future__ import annotations

import argparse
import uuid
from datetime import datetime
from typing import List, Optional

from threefs.pond.common import DEFAULT_MAX_FAIL_COUNT, DEFAULT_MAX_RETRY_COUNT, PondError
from threefs.pond.execution.executor import LocalExecutor, RayExecutor
from threefs.pond.execution.scheduler import Scheduler
from threefs.pond.execution.task import RuntimeContext
from threefs.pond.logical.dataset import DataSet
from threefs.pond.logical.node import LogicalPlan
from threefs.pond.logical.planner import Planner


class Driver:
    def __init__(self) -> None:
        p = argparse.ArgumentParser(description="pond driver (smallpond-compatible flags)")
        p.add_argument("mode", nargs="?", default="scheduler", choices=["scheduler", "executor", "ray"])
        p.add_argument("--job_id", default=None)
        p.add_argument("--job_time", default=None, help="ISO time; with --job_id, a rerun resumes the job")
        p.add_argument("--job_name", default="pond")
        p.add_argument("--data_root", default=None)
        p.add_argument("--num_executors", type=int, default=0, help="local worker processes (default: CPUs)")
        p.add_argument("--ray_address", default=None)
        p.add_argument("--max_retry", "--max_retry_count", dest="max_retry", type=int, default=DEFAULT_MAX_RETRY_COUNT)
        p.add_argument("--max_fail", "--max_fail_count", dest="max_fail", type=int, default=DEFAULT_MAX_FAIL_COUNT)
        p.add_argument("--output_path", default=None)
        p.add_argument("--platform", default=None)
        p.add_argument("--progress", action="store_true")
        # accepted for compatibility; pond has no use for them
        for flag in ("--speculative_exec", "--fault_inject", "--memory_allocator", "--memory_purge_delay",
                     "--enable_diagnostic_metrics", "--remove_output_root", "--bind_numa_node",
                     "--nonzero_exitcode_as_oom", "--prioritize_retry", "--enable_profiling"):
            p.add_argument(flag, default=None, help=argparse.SUPPRESS)
        self.parser = p
        self._args: Optional[argparse.Namespace] = None

    def add_argument(self, *args, **kwargs) -> None:
        self.parser.add_argument(*args, **kwargs)

    def get_arguments(self, argv: Optional[List[str]] = None) -> argparse.Namespace:
        if self._args is None:
            self._args = self.parser.parse_args(argv)
        return self._args

    def run(self, plan: LogicalPlan, stop_process_on_done: bool = False) -> List[DataSet]:
        """Plan into tasks and run them; returns the output data sets of the plan's root."""
        import os
        a = self.get_arguments()
        if a.mode == "executor":
            raise PondError("pond has no separate executor mode: run the driver in 'scheduler' mode (local "
                            "process pool) or 'ray' mode (--ray_address of a Ray cluster)")
        job_time = datetime.fromisoformat(a.job_time) if a.job_time else datetime.now()
        executor = RayExecutor(a.ray_address) if a.mode == "ray" or a.ray_address else \
            LocalExecutor(a.num_executors or None)
        rc = RuntimeContext(a.job_id or str(uuid.uuid4()), job_time,
                            a.data_root or os.path.expanduser("~/.pond/data"),
                            usable_cpu_count=executor.total_cpus or None, job_name=a.job_name,
                            max_retry_count=a.max_retry, max_fail_count=a.max_fail)
        rc.initialize()
        try:
            exec_plan = Planner(rc).create_exec_plan(plan)
            scheduler = Scheduler(rc, executor, progress=a.progress)
            scheduler.run([exec_plan.root_task])
            outputs = [scheduler.done[t.key] for t in exec_plan.root_task.input_deps]
            with open(rc.job_status_path, "a") as f:
                f.write(f"success@{datetime.now():%Y-%m-%d-%H-%M-%S}\n")
            rc.cleanup(remove_output_root=False)
            return outputs
        except BaseException:
            with open(rc.job_status_path, "a") as f:
                f.write(f"failure@{datetime.now():%Y-%m-%d-%H-%M-%S}\n")
            raise
        finally:
            executor.shutdown()
