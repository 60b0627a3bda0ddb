"""The driver's scheduler: runs the tasks of an execution plan on an executor in dependency order.

- inline tasks (descriptor bookkeeping) run here as soon as their inputs are ready;
- a task whose worker died is retried (max_retry_count attempts), one that raised is retried
  (max_fail_count attempts), then the job fails with the task's own message;
- completed tasks leave a marker, so a rerun of a failed job (same job_id, job_time, data_root) skips them;
- a task asking for more CPUs or memory than any executor has fails the job before anything runs.
"""

from __future__ import annotations

import copy
import os
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from threefs.pond.common import PondError, TaskFailedError, UnschedulableError
from threefs.pond.execution.executor import LOST, Executor
from threefs.pond.execution.task import RuntimeContext, Task, read_marker
from threefs.pond.logical.dataset import DataSet

WAIT_SLICE_SECONDS = 0.5


@dataclass
class TaskRecord:
    key: str
    node_id: int
    submitted: float
    started: float = 0.0
    finished: float = 0.0
    worker: str = ""
    status: str = "running"
    attempt: int = 0


@dataclass
class JobStats:
    records: List[TaskRecord] = field(default_factory=list)
    resumed: int = 0
    executed: int = 0
    retried: int = 0


def collect_tasks(roots: List[Task]) -> List[Task]:
    """All tasks below roots, each after its inputs."""
    order: List[Task] = []
    seen = set()
    stack = [(t, False) for t in reversed(roots)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            if t.key not in seen:
                seen.add(t.key)
                order.append(t)
            continue
        if t.key in seen:
            continue
        stack.append((t, True))
        for d in reversed(t.input_deps):
            if d.key not in seen:
                stack.append((d, False))
    return order


def check_schedulable(tasks: List[Task], executor: Executor) -> None:
    for t in tasks:
        if t.inline:
            continue
        if t.cpu_limit > executor.max_task_cpus:
            raise UnschedulableError(
                f"{t.key} (node at {t.location}) asks for {t.cpu_limit} CPUs, but the largest {executor.name} "
                f"executor has {executor.max_task_cpus}; it could never run. Lower cpu_limit or add bigger executors.")
        if t.memory_limit and executor.max_task_memory and t.memory_limit > executor.max_task_memory:
            raise UnschedulableError(
                f"{t.key} (node at {t.location}) asks for {t.memory_limit / 2**30:.1f} GiB of memory, but the largest "
                f"{executor.name} executor has {executor.max_task_memory / 2**30:.1f} GiB; it could never run. "
                "Lower memory_limit or add bigger executors.")


_user_modules_done: set = set()


def _pickle_user_modules_by_value() -> None:
    """Functions from the user's own modules (scripts, tests) travel by value: a worker (a Ray worker on another
    host) may not be able to import them."""
    import cloudpickle
    skip = tuple(os.path.realpath(p) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                                 sysconfig.get_paths()["platlib"]})
    pkg = os.path.realpath(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    for name, mod in list(sys.modules.items()):
        if name in _user_modules_done or name == "__main__":
            continue
        f = getattr(mod, "__file__", None)
        if not f:
            continue
        real = os.path.realpath(f)
        _user_modules_done.add(name)
        if real.startswith(skip) or real.startswith(pkg + os.sep) or "site-packages" in real:
            continue
        try:
            cloudpickle.register_pickle_by_value(mod)
        except Exception:
            pass


def _payload(task: Task, inputs: List[DataSet]) -> bytes:
    import cloudpickle
    slim = copy.copy(task)
    slim.input_deps = []
    try:
        return cloudpickle.dumps((slim, inputs))
    except Exception as e:
        hint = ""
        if "loguru" in sys.modules and "pickle" in str(e).lower():
            hint = ("\nHINT: DO NOT use externally imported loguru logger in your task. "
                    "Please import it within the task.")
        raise PondError(f"Can't pickle task '{task.key}' (node at {task.location}): {type(e).__name__}: {e}{hint}") \
            from None


class Scheduler:
    def __init__(self, runtime_ctx: RuntimeContext, executor: Executor, progress: bool = False) -> None:
        self.runtime_ctx = runtime_ctx
        self.executor = executor
        self.progress = progress
        self.done: Dict[str, DataSet] = {}
        self.stats = JobStats()
        self.progress_desc = "pond tasks"  # the progress bar's label (a caller may name its phase)

    def forget(self, predicate) -> None:
        """Drop results (and markers) of the tasks matching predicate(key) — recompute()."""
        from threefs.pond.io import filesystem as pfs
        for key in [k for k in self.done if predicate(k)]:
            del self.done[key]
        root = self.runtime_ctx.completed_task_dir
        if pfs.exists(root):
            for name in pfs.listdir(root):
                if predicate(name.rsplit(".pickle", 1)[0]):
                    pfs.remove_path(os.path.join(root, name))

    def run(self, roots: List[Task]) -> List[DataSet]:
        tasks = collect_tasks(roots)
        pending = [t for t in tasks if t.key not in self.done]
        for t in pending:
            if not t.inline:
                out = read_marker(t)
                if out is not None:
                    self.done[t.key] = out
                    self.stats.resumed += 1
        pending = [t for t in pending if t.key not in self.done]
        check_schedulable(pending, self.executor)
        _pickle_user_modules_by_value()
        self._loop(pending)
        return [self.done[t.key] for t in roots]

    def _loop(self, pending: List[Task]) -> None:
        bar = _progress_bar(sum(1 for t in pending if not t.inline), self.progress, self.progress_desc)
        running: Dict[object, tuple] = {}
        lost: Dict[str, int] = {}
        failed: Dict[str, int] = {}
        free = self.executor.total_cpus
        error: Optional[TaskFailedError] = None
        try:
            while pending or running:
                still = []
                for t in pending:
                    if not all(d.key in self.done for d in t.input_deps):
                        still.append(t)
                        continue
                    inputs = [self.done[d.key] for d in t.input_deps]
                    if t.inline:
                        self.done[t.key] = t.run_inline(inputs)
                        continue
                    need = min(t.cpu_limit, self.executor.total_cpus)
                    if self.executor.bounded_slots and running and need > free:
                        still.append(t)
                        continue
                    t.attempt = lost.get(t.key, 0) + failed.get(t.key, 0)
                    handle = self.executor.submit(_payload(t, inputs), t.cpu_limit, t.memory_limit)
                    rec = TaskRecord(t.key, t.node_id, time.time(), attempt=t.attempt)
                    self.stats.records.append(rec)
                    running[handle] = (t, rec, need)
                    free -= need
                pending = still
                if not running:
                    if pending and error is None:
                        raise PondError(f"scheduler stuck: {len(pending)} tasks wait for inputs that never ran "
                                        f"(first: {pending[0].key})")
                    break
                for handle, outcome in self.executor.wait(list(running), WAIT_SLICE_SECONDS):
                    t, rec, need = running.pop(handle)
                    free += need
                    try:
                        requeue = self._finish(t, rec, outcome, lost, failed)
                    except TaskFailedError as e:
                        # the job fails: submit nothing more, but let the running tasks finish (their results
                        # and markers are kept, so a rerun resumes from them), then report the first error
                        error = error or e
                        pending = []
                        continue
                    if requeue and error is None:
                        pending.insert(0, t)
                        self.stats.retried += 1
                    elif not requeue:
                        bar.update(1)
            if error is not None:
                raise error
        finally:
            bar.close()

    def _finish(self, t: Task, rec: TaskRecord, outcome, lost: Dict[str, int], failed: Dict[str, int]) -> bool:
        """Record a finished attempt; True when the task must run again."""
        import cloudpickle
        rec.finished = time.time()
        if outcome == LOST:
            rec.status = "lost"
            lost[t.key] = lost.get(t.key, 0) + 1
            if lost[t.key] >= self.runtime_ctx.max_retry_count:
                raise TaskFailedError(f"{t.key} (node at {t.location}): its executor died {lost[t.key]} times "
                                      "(killed or out of memory); giving up")
            return True
        status, value, started, finished, pid = cloudpickle.loads(outcome)
        rec.started, rec.finished, rec.worker = started, finished, str(pid)
        if status == "ok":
            rec.status = "ok"
            self.done[t.key] = value
            self.stats.executed += 1
            return False
        rec.status = "failed"
        failed[t.key] = failed.get(t.key, 0) + 1
        if failed[t.key] >= self.runtime_ctx.max_fail_count:
            raise TaskFailedError(f"task failed after {failed[t.key]} attempts: {value}")
        return True


class _NoBar:
    def update(self, n): pass
    def close(self): pass


def _progress_bar(total: int, enabled: bool, desc: str = "pond tasks"):
    if not enabled or total == 0:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="task", leave=False, file=sys.stderr)
