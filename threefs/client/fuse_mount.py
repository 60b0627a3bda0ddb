"""Mounting: the FUSE daemon's process (foreground or spawned), clean unmount, stale-mount cleanup.

    threefs mount MNT [--foreground]     # spawns the daemon, returns once MNT serves
    threefs umount MNT                   # unmounts; also cleans up after a daemon that died

The daemon unmounts on SIGINT/SIGTERM. A daemon killed with SIGKILL leaves the mount behind
(`Transport endpoint is not connected`); `threefs umount` (fusermount3 -u, then -uz) removes it, and
`threefs mount` on such a mount point removes it first.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from threefs.common.status import StatusCode, ThreeFSError, status_error

log = logging.getLogger(__name__)

MOUNT_READY_TIMEOUT_S = 30.0
UNMOUNT_TIMEOUT_S = 10.0
READ_AHEAD_TRIES = 40
SYNC_AT_EXIT_TIMEOUT_S = 30.0
FUSERMOUNT = "fusermount3"
WORKERS_KEPT = 32  # pyfuse3 worker tasks kept waiting for kernel requests (its default: 1)
WORKERS_MAX = 99  # pyfuse3's default cap
KERNEL_SPIN_S = 1000e-6  # the daemon polls after a kernel request while they come this close (spin.py Spinner)


def fuse_unavailable_reason() -> str | None:
    """Why FUSE cannot be used here, in words a person can act on; None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (load the fuse module, or give the container --device /dev/fuse)"
    if shutil.which(FUSERMOUNT) is None:
        return f"{FUSERMOUNT} is not installed (apt-get install fuse3, or run scripts/setup-system.sh)"
    try:
        importlib.import_module("pyfuse3")  # built against this machine's libfuse3
    except ImportError as e:
        return (f"pyfuse3 is not importable ({e}); run scripts/setup-system.sh then "
                "scripts/setup-venv.sh (it needs libfuse3-dev and pkg-config to build)")
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    return None


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_entry(mountpoint: str | os.PathLike) -> tuple[str, str] | None:
    """(major:minor, fs type) of the mount at mountpoint, from /proc/self/mountinfo (never stats it:
    a dead FUSE mount would answer ENOTCONN, a live one of our own process would deadlock)."""
    target = os.path.abspath(mountpoint)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            if _unescape(fields[4]) == target:
                found = (fields[2], fields[sep + 1])  # the last one listed is on top
    return found


def is_threefs_mount(mountpoint) -> bool:
    entry = mount_entry(mountpoint)
    return entry is not None and entry[1] == "fuse.threefs"


async def tune_read_ahead(mountpoint: str, read_ahead_kb: int, initialized: asyncio.Event,
                          negotiated: dict | None = None) -> None:
    """Raise the mount's read-ahead (default 128 KiB) so sequential reads arrive as many large requests.

    The kernel sets read-ahead from the FUSE INIT reply, which it processes after our init handler
    returns, so write it once INIT is through and check that it stuck."""
    entry = mount_entry(mountpoint)
    if entry is None or read_ahead_kb <= 0:
        return
    path = Path(f"/sys/class/bdi/{entry[0]}/read_ahead_kb")
    await initialized.wait()
    if negotiated:
        log.info("FUSE connection: max_write %d, max_readahead %d, max_background %d, congestion_threshold "
                 "%d, want %#x", negotiated.get("max_write", 0), negotiated.get("max_readahead", 0),
                 negotiated.get("max_background", 0), negotiated.get("congestion_threshold", 0),
                 negotiated.get("want", 0))
    for _ in range(READ_AHEAD_TRIES):
        await asyncio.sleep(0.05)
        try:
            path.write_text(str(read_ahead_kb))
            if int(path.read_text()) == read_ahead_kb:
                log.info("read_ahead_kb of %s is %d", mountpoint, read_ahead_kb)
                return
        except (OSError, ValueError) as e:
            log.warning("cannot set %s to %d (sequential reads stay slower): %s", path, read_ahead_kb, e)
            return
    log.warning("%s did not keep %d; sequential reads stay slower", path, read_ahead_kb)


def unmount(mountpoint: str | os.PathLike, timeout_s: float = UNMOUNT_TIMEOUT_S) -> bool:
    """Unmount a threefs mount; lazily if it is busy or its daemon is dead. False if nothing was mounted."""
    mnt = os.path.abspath(mountpoint)
    if mount_entry(mnt) is None:
        return False
    if not is_threefs_mount(mnt):
        raise status_error(StatusCode.INVALID_ARGUMENT, f"{mnt} is not a threefs mount; not touching it")
    for args in ([FUSERMOUNT, "-u", mnt], [FUSERMOUNT, "-u", "-z", mnt]):
        r = subprocess.run(args, capture_output=True, text=True)
        if r.returncode == 0 and _wait(lambda: mount_entry(mnt) is None, timeout_s):
            return True
        log.info("%s: %s", " ".join(args), r.stderr.strip())
    raise status_error(StatusCode.BUSY, f"could not unmount {mnt}: {r.stderr.strip()}")


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _prepare_mountpoint(mnt: str) -> None:
    if mount_entry(mnt) is not None:
        if not is_threefs_mount(mnt):
            raise status_error(StatusCode.BUSY, f"{mnt} is already a mount point of something else")
        try:
            os.stat(mnt)  # answers: a daemon serves it
        except OSError:
            unmount(mnt)  # a dead daemon's leftover
        else:
            raise status_error(StatusCode.BUSY, f"threefs is already mounted at {mnt} "
                               f"(`threefs umount {mnt}` first)")
    os.makedirs(mnt, exist_ok=True)
    if not os.path.isdir(mnt):
        raise status_error(StatusCode.NOT_DIRECTORY, f"mount point {mnt} is not a directory")


def run_foreground(config, mountpoint: str, options) -> int:
    """Mount and serve until unmounted or signalled (SIGINT/SIGTERM unmount cleanly)."""
    reason = fuse_unavailable_reason()
    if reason:
        raise status_error(StatusCode.NOT_SUPPORTED, f"cannot mount: {reason}")
    mnt = os.path.abspath(mountpoint)
    _prepare_mountpoint(mnt)
    import pyfuse3
    import pyfuse3.asyncio
    import uvloop

    pyfuse3.asyncio.enable()
    if getattr(options, "fast_dispatch", True):
        _fast_wait_readable(pyfuse3.asyncio)
    uvloop.run(_serve(config, mnt, options))
    return 0


async def _serve(config, mnt: str, options) -> None:
    import pyfuse3

    from threefs.client import fuse_fallocate
    from threefs.client.aio import AsyncClient
    from threefs.client.fuse import ThreeFSOperations
    from threefs.common.spin import CLIENT_SPIN_S_MAX, Spinner
    from threefs.rpc.client import LoopSpin

    aio = await AsyncClient(config).start()
    # the daemon's loop has nothing else to do while a quick answer from meta or storage is due: it polls
    # for it instead of sleeping (rpc/client.py LoopSpin; THREEFS_RPC_SPIN_US=0 turns both spins off)
    aio.rpc.spin = LoopSpin() if CLIENT_SPIN_S_MAX > 0 else None
    ops = ThreeFSOperations(aio, options)
    # and while the kernel's requests come close together, it polls for the next one (common/spin.py)
    ops.spinner = Spinner(KERNEL_SPIN_S) if CLIENT_SPIN_S_MAX > 0 else None
    fuse_options = set(pyfuse3.default_options) | {"fsname=threefs", "subtype=threefs"}
    if options.allow_other:
        fuse_options.add("allow_other")
    loop = asyncio.get_running_loop()
    stopping = []

    async def drain_then_stop() -> None:
        # The kernel may still hold written pages (write-back cache): have it send them while the
        # loop still serves, so a signal never drops data a program already wrote.
        try:
            await asyncio.wait_for(asyncio.to_thread(_syncfs, mnt), SYNC_AT_EXIT_TIMEOUT_S)
        except Exception as e:
            log.warning("could not flush the kernel's cached writes of %s: %s", mnt, e)
        pyfuse3.terminate()

    def stop(signame: str) -> None:
        if not stopping:
            log.info("%s: unmounting %s", signame, mnt)
            stopping.append(asyncio.ensure_future(drain_then_stop()))

    # The handlers go in before the mount appears (spawn() and scripts take a visible mount for a running
    # daemon, and a signal's default action would kill it there: a SIGUSR1 at once after the mount killed
    # the daemon in a test run); they run from the first await on, in pyfuse3.main, once the session serves.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop, sig.name)
    loop.add_signal_handler(signal.SIGUSR1, _log_stats, ops)  # `kill -USR1 PID`: the counters so far
    pyfuse3.init(ops, mnt, fuse_options)
    fuse_fallocate.install_init(options.max_background, options.max_background * 3 // 4, ops.negotiated)
    fuse_fallocate.install(ops)  # pyfuse3 does not pass fallocate on
    if getattr(options, "dir_cache", True) and not options.direct_io:
        ops.dir_cache = fuse_fallocate.install_dir_cache()
    if not ops.enable_writeback_cache:  # (the kernel flushes cached writes at close with one anyway)
        fuse_fallocate.install_open_noflush()
    ops.watch_kernel_queue(fuse_fallocate.session_fd())
    tuner = asyncio.ensure_future(tune_read_ahead(mnt, options.read_ahead_kb, ops.initialized, ops.negotiated))
    mounted = True
    try:
        # workers kept waiting for requests: pyfuse3 ends a worker as soon as two are idle and starts one
        # when none is, so a burst of concurrent requests (io_depth 32) created and ended tasks per request
        tasks = WORKERS_KEPT if getattr(options, "fast_dispatch", True) else 1
        await pyfuse3.main(min_tasks=tasks, max_tasks=max(WORKERS_MAX, tasks))
    except BaseException:
        log.exception("FUSE main loop failed")
        raise
    finally:
        tuner.cancel()
        _stop_watching()
        _log_stats(ops)
        await ops.release_all()
        try:
            pyfuse3.close(unmount=mounted)
        finally:
            if mount_entry(mnt) is not None:  # busy: detach it lazily, never leave it dangling
                subprocess.run([FUSERMOUNT, "-u", "-z", mnt], capture_output=True)
            await aio.close()


def _log_stats(ops) -> None:
    gate = ops._gate
    log.info("requests served: %s; small reads %d in %d storage batches; gate: %d reads in %d openings; "
             "kernel requests: %s; meta calls: %s; page cache stores: %s", dict(ops.stats),
             ops._coalescer.reads, ops._coalescer.batches, gate.held if gate else 0,
             gate.batches if gate else 0, dict(ops.requests), dict(ops.aio.meta_calls), dict(ops._store.stats))


def _fast_wait_readable(pyfuse3_asyncio) -> None:
    """pyfuse3's asyncio layer waits for /dev/fuse with add_reader + remove_reader (two epoll_ctl calls, a
    handle and a callback) before every request. Here the descriptor stays registered with the loop while
    a worker waits (only the worker holding pyfuse3's read lock waits, so there is at most one), and the
    reader callback wakes it: a request costs no epoll change. The poll is level-triggered, so the callback
    also fires while the woken worker has not read yet (one loop turn) and while every worker is busy with
    requests queued in the kernel: the IDLE_FIRES_MAX-th such turn with no worker waiting since the last
    one began to wait unregisters the descriptor (the requests wait in the kernel's queue, as before,
    instead of the loop spinning on them), and the next waiter registers it again. The waiter's future is
    in pyfuse3's `_read_futures`, so `pyfuse3.terminate()` wakes it as it would pyfuse3's own;
    `_stop_watching` ends the registration before the session closes the descriptor."""

    async def wait_readable(fd) -> None:
        watch = _WATCHES.get(fd)
        if watch is None:
            watch = _WATCHES[fd] = _ReadableWatch(asyncio.get_running_loop(), fd)
        await watch.wait(pyfuse3_asyncio._read_futures)

    pyfuse3_asyncio.wait_readable = wait_readable


def _stop_watching() -> None:
    for watch in _WATCHES.values():
        watch.stop()
    _WATCHES.clear()


# A woken worker reads on the turn after the one that woke it, and the next worker waits a turn or two
# later (pyfuse3's read lock changes hands): fewer turns than this with nobody waiting are that, not a
# daemon whose workers are all busy.
IDLE_FIRES_MAX = 3
_WATCHES: dict[int, "_ReadableWatch"] = {}  # fd -> its watch (the daemon's one /dev/fuse session)


class _ReadableWatch:
    """One descriptor's readability for one waiter at a time (see _fast_wait_readable)."""

    __slots__ = ("loop", "fd", "waiter", "registered", "idle", "_poll")

    def __init__(self, loop, fd: int):
        self.loop, self.fd = loop, fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self.waiter: asyncio.Future | None = None
        self.registered = False
        self.idle = 0  # turns on which the descriptor was readable and nobody waited, since one last waited

    def stop(self) -> None:
        if self.registered:
            self.registered = False
            self.loop.remove_reader(self.fd)

    def _readable(self) -> None:
        waiter = self.waiter
        if waiter is None:
            self.idle += 1
            if self.idle >= IDLE_FIRES_MAX:  # nobody waits (every worker busy): stop watching until one does
                self.stop()
            return
        if not self._poll.poll(0):
            # a readiness seen before the last worker read (a loop that runs its ready callbacks after its
            # next poll, as asyncio's own does; uvloop runs them before): waking this worker would make it
            # read an empty queue
            return
        self.waiter = None
        if not waiter.done():
            waiter.set_result(None)

    async def wait(self, read_futures) -> None:
        waiter = self.loop.create_future()
        self.waiter = waiter
        self.idle = 0
        waiting = read_futures[self.fd]
        waiting.add(waiter)
        try:
            if not self.registered:
                self.loop.add_reader(self.fd, self._readable)
                self.registered = True
            await waiter
        except BaseException:  # cancelled, or the session closing (terminate): leave nothing registered
            self.stop()
            raise
        finally:
            if self.waiter is waiter:
                self.waiter = None
            waiting.discard(waiter)
            if not waiting:
                read_futures.pop(self.fd, None)


def _syncfs(mnt: str) -> None:
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), f"syncfs({mnt}) failed")
    finally:
        os.close(fd)


def stop(proc: subprocess.Popen, mountpoint: str | os.PathLike) -> None:
    """Stop a daemon started by spawn(): unmount (the daemon then exits), kill it if it does not,
    and never leave a mount or a process behind."""
    try:
        unmount(mountpoint)
    finally:
        try:
            proc.wait(timeout=UNMOUNT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=5)
            unmount(mountpoint)


def spawn(config_path: str, mountpoint: str, extra_args: list[str], log_path: str | None = None,
          timeout_s: float = MOUNT_READY_TIMEOUT_S) -> subprocess.Popen:
    """Start `threefs mount --foreground` as a background process; return once the mount serves."""
    reason = fuse_unavailable_reason()
    if reason:
        raise status_error(StatusCode.NOT_SUPPORTED, f"cannot mount: {reason}")
    mnt = os.path.abspath(mountpoint)
    _prepare_mountpoint(mnt)
    cmd = [sys.executable, "-m", "threefs.cli.main", "--config", str(config_path), "mount",
           "--foreground", *extra_args, mnt]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if log_path:
            out.close()
    if not _wait(lambda: is_threefs_mount(mnt) or proc.poll() is not None, timeout_s) or \
            proc.poll() is not None:
        if proc.poll() is None:
            proc.terminate()
        hint = f"; see {log_path}" if log_path else ""
        raise ThreeFSError(StatusCode.UNAVAILABLE, f"FUSE daemon did not mount {mnt} within "
                           f"{timeout_s:.0f} s (exit code {proc.poll()}){hint}")
    return proc
