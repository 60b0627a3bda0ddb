"""Session configuration: `init()` arguments, environment variables, the job's directories, the executor.

Fixed smallpond flaw: an explicit init() argument wins over its environment variable (smallpond lets
SP_* override what the caller wrote); the environment fills in only what the caller left out.
"""

from __future__ import annotations

import atexit
import os
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from threefs.pond.common import DEFAULT_MAX_FAIL_COUNT, DEFAULT_MAX_RETRY_COUNT, PondError
from threefs.pond.execution.executor import Executor, LocalExecutor, RayExecutor
from threefs.pond.execution.scheduler import Scheduler
from threefs.pond.execution.task import RuntimeContext
from threefs.pond.io import filesystem as pfs
from threefs.pond.logical.node import Context


def _env(name: str, arg, convert=str):
    if arg is not None:
        return arg
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return convert(value)
    except ValueError:
        raise PondError(f"environment variable {name}={value!r} is not a valid {convert.__name__}") from None


@dataclass
class Config:
    job_id: str
    job_time: datetime
    job_name: str
    data_root: str
    num_executors: int
    ray_address: Optional[str]
    executor: str
    num_cpus: Optional[int]
    memory: Optional[int]
    remove_output_root: bool
    progress: bool
    max_retry_count: int
    max_fail_count: int
    threefs_mount: Optional[str] = None


def make_config(job_id=None, job_time=None, job_name=None, data_root=None, num_executors=None, ray_address=None,
                bind_numa_node=None, platform=None, _remove_output_root=True, executor=None, num_cpus=None,
                memory=None, progress=None, max_retry_count=None, max_fail_count=None, threefs_mount=None,
                **kwargs) -> Config:
    job_id = _env("SP_JOBID", job_id) or str(uuid.uuid4())
    job_time = _env("SP_JOB_TIME", job_time, datetime.fromisoformat) or datetime.now()
    if isinstance(job_time, str):
        job_time = datetime.fromisoformat(job_time)
    data_root = _env("SP_DATA_ROOT", data_root) or os.path.expanduser("~/.pond/data")
    num_executors = _env("SP_NUM_EXECUTORS", num_executors, int) or 0
    ray_address = _env("SP_RAY_ADDRESS", ray_address)
    executor = _env("POND_EXECUTOR", executor) or ("ray" if ray_address else "local")
    if executor not in ("local", "ray"):
        raise PondError(f"executor must be 'local' or 'ray', got {executor!r}")
    num_cpus = _env("POND_NUM_CPUS", num_cpus, int)
    if num_cpus is None and num_executors and executor == "local":
        num_cpus = num_executors
    if progress is None:
        import sys
        progress = sys.stderr.isatty()
    return Config(job_id=str(job_id), job_time=job_time, job_name=job_name or "pond", data_root=data_root,
                  num_executors=num_executors, ray_address=ray_address, executor=executor, num_cpus=num_cpus,
                  memory=memory, remove_output_root=_remove_output_root, progress=progress,
                  max_retry_count=max_retry_count or DEFAULT_MAX_RETRY_COUNT,
                  max_fail_count=max_fail_count or DEFAULT_MAX_FAIL_COUNT,
                  threefs_mount=_env("POND_THREEFS_MOUNT", threefs_mount))


class SessionBase:
    def __init__(self, **kwargs) -> None:
        self.config = make_config(**kwargs)
        self._ctx = Context()
        mount = self.config.threefs_mount
        if mount:
            from threefs.client import fuse_mount
            if not fuse_mount.is_threefs_mount(mount):
                raise PondError(f"threefs_mount={mount!r} is not a mounted threefs file system "
                                "(mount it with `threefs mount DIR`, or leave threefs_mount out)")
            mount = os.path.abspath(mount)
        pfs.configure(pfs.current_config(), mount)
        executor = self._make_executor()
        self._executor: Executor = executor
        self._runtime_ctx = RuntimeContext(self.config.job_id, self.config.job_time, self.config.data_root,
                                           num_executors=max(1, self.config.num_executors),
                                           usable_cpu_count=executor.total_cpus if executor.total_cpus else None,
                                           job_name=self.config.job_name,
                                           max_retry_count=self.config.max_retry_count,
                                           max_fail_count=self.config.max_fail_count)
        self._runtime_ctx.initialize()
        self._scheduler = Scheduler(self._runtime_ctx, executor, progress=self.config.progress)
        self._failed = False
        atexit.register(self.shutdown)

    def _make_executor(self) -> Executor:
        if self.config.executor == "ray":
            return RayExecutor(self.config.ray_address, self.config.num_cpus)
        return LocalExecutor(self.config.num_cpus, self.config.memory)

    @property
    def runtime_ctx(self) -> RuntimeContext:
        return self._runtime_ctx

    def shutdown(self) -> None:
        if getattr(self, "_shutdown_called", False):
            return
        self._shutdown_called = True
        ok = not self._failed
        try:
            with open(self._runtime_ctx.job_status_path, "a") if not pfs.is_threefs(self._runtime_ctx.job_status_path) \
                    else _ThreefsAppend(self._runtime_ctx.job_status_path) as f:
                f.write(f"{'success' if ok else 'failure'}@{datetime.now():%Y-%m-%d-%H-%M-%S}\n")
        except OSError:
            pass
        if ok:
            self._runtime_ctx.cleanup(remove_output_root=self.config.remove_output_root)
        self._executor.shutdown()


class _ThreefsAppend:
    def __init__(self, path):
        self.path = path
        self.parts = []

    def __enter__(self):
        return self

    def write(self, s):
        self.parts.append(s)

    def __exit__(self, *exc):
        old = pfs.read_bytes(self.path).decode() if pfs.exists(self.path) else ""
        pfs.write_text(self.path, old + "".join(self.parts))
