"""Executors: where tasks run. LocalExecutor is a pool of worker processes on this host (the default, no Ray);
RayExecutor submits each task as a Ray task (several hosts). Both run `execute_payload` on a pickled
(task, input data sets) and give back its pickled outcome, so results are the same on both."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from threefs.pond.common import GB, PondError
from threefs.pond.execution.task import execute_payload

LOST = "lost"  # outcome of a task whose worker died


class Executor:
    name = "executor"
    total_cpus: int = 1
    max_task_cpus: int = 1
    max_task_memory: int = 0
    bounded_slots = True  # the scheduler keeps running cpu_limits within total_cpus

    def submit(self, payload: bytes, cpus: int, memory: Optional[int]) -> Any:
        raise NotImplementedError

    def wait(self, handles: List[Any], timeout: float) -> List[Tuple[Any, Any]]:
        """(handle, outcome bytes or LOST) of the handles that finished within timeout."""
        raise NotImplementedError

    def worker_pids(self) -> List[int]:
        return []

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def _main_hidden():
    """Start workers without re-running the user's script in them: multiprocessing re-imports `__main__`
    (by path or module name) in every forkserver child, which runs a script without an
    `if __name__ == "__main__"` guard — a smallpond script — again in each worker. Tasks travel pickled by
    value, so workers never need `__main__`."""
    main = sys.modules.get("__main__")
    saved = {a: getattr(main, a) for a in ("__file__", "__spec__") if main is not None and hasattr(main, a)}
    try:
        if main is not None:
            if "__file__" in saved:
                del main.__file__
            main.__spec__ = None
        yield
    finally:
        for a, v in saved.items():
            setattr(main, a, v)


def _preload() -> None:
    import duckdb  # noqa: F401
    import pyarrow.parquet  # noqa: F401


class LocalExecutor(Executor):
    """A pool of `num_workers` processes (forkserver: workers fork from a clean process that already imported
    DuckDB and Arrow, so they start in milliseconds and never inherit the driver's threads)."""

    name = "local"

    def __init__(self, num_workers: Optional[int] = None, memory: Optional[int] = None) -> None:
        self.total_cpus = int(num_workers or os.cpu_count() or 1)
        self.max_task_cpus = self.total_cpus
        self.max_task_memory = int(memory or _machine_memory())
        self._pool: Optional[cf.ProcessPoolExecutor] = None

    def _ensure(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["duckdb", "pyarrow", "pyarrow.parquet", "threefs.pond.execution.task"])
            self._pool = cf.ProcessPoolExecutor(max_workers=self.total_cpus, mp_context=ctx)
        return self._pool

    def submit(self, payload: bytes, cpus: int, memory: Optional[int]):
        with _main_hidden():
            try:
                return self._ensure().submit(execute_payload, payload)
            except cf.process.BrokenProcessPool:
                self._restart()
                return self._ensure().submit(execute_payload, payload)

    def wait(self, handles, timeout):
        done, _ = cf.wait(handles, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        out = []
        broken = False
        for f in done:
            exc = f.exception()
            if exc is None:
                out.append((f, f.result()))
            elif isinstance(exc, cf.process.BrokenProcessPool):
                out.append((f, LOST))
                broken = True
            else:
                raise exc
        if broken:
            self._restart()
        return out

    def _restart(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def worker_pids(self) -> List[int]:
        if self._pool is None:
            return []
        return [p.pid for p in list(getattr(self._pool, "_processes", {}).values())]

    def warm_up(self) -> None:
        """Start the worker processes now (they are otherwise started by the first tasks)."""
        with _main_hidden():
            pool = self._ensure()
            list(pool.map(_noop, range(self.total_cpus)))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _noop(_):
    return os.getpid()


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 * GB


class RayExecutor(Executor):
    """Each task is a Ray task with num_cpus = its cpu_limit (and memory when the node asks for it). Connects to
    `address`, or starts a Ray instance on loopback without a dashboard."""

    name = "ray"
    bounded_slots = False

    def __init__(self, address: Optional[str] = None, num_cpus: Optional[int] = None) -> None:
        import ray
        self._ray = ray
        self._owned = False
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                         log_to_driver=False)
                self._owned = True
        self._remote = ray.remote(max_retries=0)(execute_payload)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.max_task_cpus = int(max((n["Resources"].get("CPU", 0) for n in nodes), default=0))
        self.max_task_memory = int(max((n["Resources"].get("memory", 0) for n in nodes), default=0))
        self.total_cpus = int(sum(n["Resources"].get("CPU", 0) for n in nodes))

    def submit(self, payload: bytes, cpus: int, memory: Optional[int]):
        opts: Dict[str, Any] = {"num_cpus": cpus}
        if memory:
            opts["memory"] = memory
        return self._remote.options(**opts).remote(payload)

    def wait(self, handles, timeout):
        ray = self._ray
        ready, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        out = []
        for ref in ready:
            try:
                out.append((ref, ray.get(ref)))
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError,
                    ray.exceptions.ObjectLostError, ray.exceptions.RaySystemError):
                out.append((ref, LOST))
            except ray.exceptions.RayTaskError as e:  # execute_payload itself failed: not user code
                raise PondError(f"pond worker failed on Ray: {e}") from None
        return out

    def worker_pids(self) -> List[int]:
        return []

    def shutdown(self) -> None:
        if self._owned:
            self._ray.shutdown()
