"""`threefs put` / `get`: the parallel copy engine of the CLI.

Copies take many sources and -r like cp, run COPY_WORKERS files at once (hiding the meta round trips of
small files), show a progress bar on a terminal, go on past a failing file, name each failure on stderr
and exit 1.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from threefs.cli import client_for
from threefs.cli.files import join_path
from threefs.client import DIRECTORY
from threefs.common.status import StatusCode, status_error

COPY_WORKERS = 8  # files copied at once by put/get (hides meta round trips of small files)


class Progress:
    """A rich progress bar on a terminal, silence elsewhere."""

    def __init__(self, enabled: bool, total: int, what: str):
        self._bar = None
        if enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import Progress as Bar
            self._bar = Bar("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
            self._task = self._bar.add_task(what, total=total)

    def __enter__(self):
        if self._bar is not None:
            self._bar.start()
        return self

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.stop()


def _plan_put(fs, sources: list[str], remote: str, recursive: bool) -> list[tuple[str, str, int]]:
    """(local file, remote path, bytes) for every file to copy; creates the remote directories."""
    try:
        into = fs.stat(remote).type == DIRECTORY
    except FileNotFoundError:
        into = False
    if len(sources) > 1 and not into:
        raise status_error(StatusCode.NOT_DIRECTORY, f"copying several sources needs an existing "
                           f"directory as target; {remote} is not one")
    plan = []
    for src in sources:
        base = join_path(remote, Path(src).name) if into else remote
        if not os.path.isdir(src):
            plan.append((src, base, os.path.getsize(src)))
            continue
        if not recursive:
            raise status_error(StatusCode.IS_DIRECTORY, f"{src} is a directory (use put -r)")
        for dirpath, _dirs, filenames in os.walk(src):
            rel = os.path.relpath(dirpath, src)
            target = base if rel == "." else join_path(base, rel.replace(os.sep, "/"))
            fs.mkdir(target, parents=True, exist_ok=True)
            for name in sorted(filenames):
                local = os.path.join(dirpath, name)
                plan.append((local, join_path(target, name), os.path.getsize(local)))
    return plan


def _plan_get(fs, sources: list[str], local: str, recursive: bool) -> list[tuple[str, str, int]]:
    """(remote file, local path, bytes) for every file to copy; creates the local directories."""
    into = os.path.isdir(local)
    if len(sources) > 1 and not into:
        raise status_error(StatusCode.NOT_DIRECTORY, f"copying several sources needs an existing "
                           f"directory as target; {local} is not one")
    plan = []
    for src in sources:
        attr = fs.stat(src)
        base = os.path.join(local, PurePosixPath(src.rstrip("/")).name or "root") if into else local
        if attr.type != DIRECTORY:
            plan.append((src, base, attr.length))
            continue
        if not recursive:
            raise status_error(StatusCode.IS_DIRECTORY, f"{src} is a directory (use get -r)")
        prefix = src.rstrip("/")
        os.makedirs(base, exist_ok=True)
        for path, a in fs.walk_files(src):
            target = os.path.join(base, *PurePosixPath(path[len(prefix):].lstrip("/")).parts)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            plan.append((path, target, a.length))
    return plan


def _copy_all(plan, copy_one, show_progress: bool, what: str) -> tuple[int, int]:
    """Run copy_one(src, dst, progress) over the plan, COPY_WORKERS at once; returns (files, bytes)."""
    total = sum(n for _, _, n in plan)
    done_files, done_bytes, failed = 0, 0, []
    with Progress(show_progress, total, what) as bar, ThreadPoolExecutor(COPY_WORKERS) as pool:
        futures = [(src, pool.submit(copy_one, src, dst, bar.advance)) for src, dst, _ in plan]
        for src, fut in futures:
            try:
                done_bytes += fut.result()
                done_files += 1
            except OSError as e:
                failed.append(f"{src}: {e}")
    for f in failed:
        print(f"threefs {what}: {f}", file=sys.stderr)
    if failed:
        raise status_error(StatusCode.IO_ERROR, f"{len(failed)} of {len(plan)} files failed (listed above)")
    return done_files, done_bytes


def _progress_wanted(args) -> bool:
    return not args.quiet and sys.stderr.isatty()


def cmd_put(args) -> int:
    *sources, remote = args.paths
    with client_for(args) as fs:
        plan = _plan_put(fs, sources, remote, args.recursive)
        t0 = time.perf_counter()
        files, nbytes = _copy_all(plan, lambda s, d, p: fs.put(s, d, progress=p), _progress_wanted(args),
                                  "put")
    _summary(files, nbytes, time.perf_counter() - t0, remote, args.quiet)
    return 0


def cmd_get(args) -> int:
    *sources, local = args.paths
    with client_for(args) as fs:
        plan = _plan_get(fs, sources, local, args.recursive)
        t0 = time.perf_counter()
        files, nbytes = _copy_all(plan, lambda s, d, p: fs.get(s, d, progress=p), _progress_wanted(args),
                                  "get")
    _summary(files, nbytes, time.perf_counter() - t0, local, args.quiet)
    return 0


def _summary(files: int, nbytes: int, seconds: float, dest: str, quiet: bool) -> None:
    if not quiet:
        rate = nbytes / seconds / 1e6 if seconds > 0 else 0.0
        print(f"{files} file{'s' if files != 1 else ''}, {nbytes} bytes -> {dest} "
              f"in {seconds:.2f} s ({rate:.0f} MB/s)")


