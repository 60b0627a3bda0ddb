"""Waiting by spinning instead of sleeping, while a CPU is free for it.

Why. A process that sleeps until its peer's message arrives costs both sides: the sender's system call must
wake it (on a VM, an interrupt to a halted virtual CPU, a VM exit), and the sleeper must be scheduled again.
On this kind of machine (a Firecracker VM, 2 vCPUs) that is ~20 us on each side of every call. Measured with
a 120-byte ping-pong between two Python processes over a Unix socket, ~5 us of work on each side:

    client sleeps, server sleeps    60-70 us per round trip   client CPU 27 us   server CPU 26-35 us
    client spins,  server sleeps    25-27                                24-27              12-13
    client sleeps, server spins     21-25                                12-15              21-24
    both spin                       12-15                                13-15              12-14

Who spins. A blocking RPC client (rpc/blocking.py) waiting for an answer that usually comes quickly (a stat,
a small read): it asks the socket without waiting until the answer is there. An RPC server (rpc/server.py)
whose requests come close together (one client calling in a loop): after a request it keeps its event loop
polling instead of sleeping, for a short while, so the next request finds it awake.

When. Only while there are no more runnable tasks than CPUs: `cpu_calm()` reads the number of runnable
tasks (the 4th field of /proc/loadavg, which counts the reader itself) every SAMPLE_S and allows spinning
while its moving average (of the last few samples) is at most the CPUs this process may use. Measured,
sampling every 5 ms: one client reading at queue depth 1 with the storage service spinning, 1.8 runnable on
average besides the sampler; 8 client processes calling one meta server, 3.7-4.0. So a spinner
never takes a CPU that another task waits for for long, and on a busy machine (8 client processes on 2 CPUs,
a storage batch saturating both) nothing spins. (The kernel's CPU pressure, /proc/pressure/cpu, did not tell
these apart: 10% of the time some task waited in the queue-depth-1 case, 6-9% with 8 clients.) Spinners also
yield the CPU at each poll (sched_yield), so a task woken on their CPU runs at once. Without /proc/loadavg
nothing spins.

Knobs: THREEFS_RPC_SPIN_US for clients (rpc/blocking.py; 0 turns it off), `rpc_spin_us` in a service's
config (0 turns it off). docs/architecture.md, "Waiting for the peer".
"""

from __future__ import annotations

import asyncio
import os
import select
import time

LOADAVG_PATH = "/proc/loadavg"
SPIN_MIN_S = 200e-6  # a server polls at least this long after a request of a close stream (Spinner)
SAMPLE_S = 0.05  # how often the runnable tasks are counted (per process)


def _client_spin_s_max() -> float:
    """THREEFS_RPC_SPIN_US: the longest average wait for answers at which a caller spins (0: never)."""
    raw = os.environ.get("THREEFS_RPC_SPIN_US", "300")
    try:
        us = float(raw)
    except ValueError:
        raise ValueError(f"THREEFS_RPC_SPIN_US={raw!r}: expected microseconds (0 turns spinning off)") from None
    if not 0 <= us <= 100_000:
        raise ValueError(f"THREEFS_RPC_SPIN_US={raw!r}: expected 0 to 100000 microseconds")
    return us * 1e-6


CLIENT_SPIN_S_MAX = _client_spin_s_max()
_spinning = [0]  # 1 while a thread of this process spins for an answer (one at a time)


class AnswerWait:
    """How a blocking client waits for its socket to become readable: first, when this peer's answers come
    quickly and a CPU is free, spin (poll without waiting) for up to twice the moving average of the waits,
    while that average is under `spin_s_max` (a busy server, a big batch: no spin); then sleep in poll().
    One thread per process spins at a time; the others sleep as before."""

    __slots__ = ("_poll", "wait_s", "spin_s_max")

    def __init__(self, fd: int, spin_s_max: float | None = None):
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self.spin_s_max = CLIENT_SPIN_S_MAX if spin_s_max is None else spin_s_max
        self.wait_s = self.spin_s_max / 2  # moving average of the waits (starts as "quick")

    def wait(self, timeout_ms: int) -> bool:
        """True once readable; False if nothing came within timeout_ms."""
        wait = self.wait_s
        t0 = time.perf_counter()
        if wait < self.spin_s_max and not _spinning[0] and cpu_calm():
            _spinning[0] = 1
            try:
                end = t0 + 2 * wait
                probe = self._poll.poll
                while not probe(0):
                    if time.perf_counter() > end:
                        break
                    os.sched_yield()  # a task woken on this CPU (the server?) runs at once
                else:
                    self.wait_s = wait * 0.75 + (time.perf_counter() - t0) * 0.25
                    return True
            finally:
                _spinning[0] = 0
        if not self._poll.poll(timeout_ms):
            return False
        self.wait_s = wait * 0.75 + (time.perf_counter() - t0) * 0.25
        return True


class _Runnable:
    """The moving average of the machine's runnable tasks, sampled by cpu_calm."""

    __slots__ = ("fd", "at_s", "avg", "cpus", "calm")

    def __init__(self):
        self.at_s = 0.0
        self.avg = -1.0
        self.calm = False
        try:
            self.cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = os.cpu_count() or 1
        try:
            self.fd = os.open(LOADAVG_PATH, os.O_RDONLY)
        except OSError:
            self.fd = -2  # nothing to count with: never calm

    def sample(self, now: float) -> bool:
        running = -1
        if self.fd >= 0:
            try:  # "0.52 0.58 0.59 3/1234 5678": 3 runnable (this reader among them)
                running = int(os.pread(self.fd, 128, 0).split()[3].split(b"/", 1)[0])
            except (OSError, ValueError, IndexError):
                os.close(self.fd)
                self.fd = -2
        if running < 0:
            self.calm = False
        else:
            self.avg = running if self.avg < 0 else self.avg * 0.5 + running * 0.5
            self.calm = self.avg < self.cpus + 0.5  # (the counts are whole: an average of 2.4 is mostly 2s)
        self.at_s = now
        return self.calm


_runnable: _Runnable | None = None


class LoopPoller:
    """Keeps an asyncio loop polling (a callback that schedules itself: epoll with no timeout) instead of
    sleeping until `until_s`, while a CPU is free (cpu_calm), yielding the CPU at each turn (sched_yield).
    `loop`: the loop polling now, if any. Spinner and rpc/client.py LoopSpin say until when."""

    def __init__(self):
        self.until_s = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None

    def poll_until(self, until_s: float) -> None:
        self.until_s = max(self.until_s, until_s)
        loop = asyncio.get_running_loop()
        if self.loop is not loop and cpu_calm():
            self.loop = loop
            loop.call_soon(self._spin)

    def _spin(self) -> None:
        if time.perf_counter() < self.until_s and cpu_calm():
            os.sched_yield()  # a task woken on this CPU (a peer?) runs at once
            self.loop.call_soon(self._spin)
        else:
            self.loop = None


class Spinner(LoopPoller):
    """Keeps an event loop polling instead of sleeping after a request, while requests come closer together
    than `window_s` on average and a CPU is free (cpu_calm): for twice that average (so the next request of
    a steady stream finds it awake), at least SPIN_MIN_S and at most `window_s`. One per RpcServer
    (rpc/server.py), and the FUSE daemon's for the kernel's requests (client/fuse.py); cheap per request (a
    clock read and a moving average).

    Twice the average, not the whole window: the window can then be wide enough for requests that come
    further apart (a create every 300-400 us, a FUSE read at queue depth 1 every ~200 us), which a fixed
    200 us window never caught (each woke a sleeping service: ~20 us of CPU on each side on this kind of VM,
    and cold caches), without polling a whole millisecond after each request of a close stream. At least
    SPIN_MIN_S (the window this had before): a stat loop's requests ~70 us apart have a long tail of gaps
    on a shared VM, and 140 us of polling missed more of them (one client's stat loop 3-15% slower)."""

    def __init__(self, window_s: float):
        super().__init__()
        self.window_s = window_s
        self.gap_s = 4 * window_s  # moving average of the time between requests (starts "far apart")
        self.last_s = 0.0
        self.clock = time.perf_counter  # (a test's own clock)

    def arrived(self) -> None:
        now = self.clock()
        gap, self.last_s = now - self.last_s, now
        self.gap_s = self.gap_s * 0.75 + min(gap, 8 * self.window_s) * 0.25
        if self.gap_s < self.window_s:
            self.poll_until(now + min(self.window_s, max(SPIN_MIN_S, 2 * self.gap_s)))


def cpu_calm() -> bool:
    """True while the machine has no more runnable tasks than CPUs for this process (module docstring)."""
    global _runnable
    r = _runnable
    if r is None:
        r = _runnable = _Runnable()
    now = time.monotonic()
    if now - r.at_s < SAMPLE_S:
        return r.calm
    return r.sample(now)


def _forget_in_child() -> None:
    global _runnable
    _spinning[0] = 0  # a thread of the parent may have been spinning at the fork
    if _runnable is not None and _runnable.fd >= 0:
        try:
            os.close(_runnable.fd)
        except OSError:
            pass
    _runnable = None


os.register_at_fork(after_in_child=_forget_in_child)
