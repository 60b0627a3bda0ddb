"""A private event loop in a background thread, so the synchronous API can drive asyncio code."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a hard dependency, this keeps imports working
    uvloop = None


# Every loop thread started and not stopped yet (held here, so one whose owner was dropped without closing
# it is still stopped at exit: see _stop_all_at_exit)
_running: set["LoopThread"] = set()
_running_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's loop threads (never touch the parent's loops)."""
    global _running_lock
    _running_lock = threading.Lock()
    _running.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LoopThread:
    def __init__(self, name: str = "threefs-client"):
        self.loop = uvloop.new_event_loop() if uvloop else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        with _running_lock:
            _running.add(self)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        """Start a coroutine on the loop from another thread; its future is for waiting on it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking call from inside the client's own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        """Run a coroutine on the loop and wait for its result (re-raising its exception)."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()
            with _running_lock:
                _running.discard(self)


@atexit.register
def _stop_all_at_exit() -> None:
    """Stop the loop threads still running when the interpreter exits (after the clients' own atexit close,
    which is registered later and so runs first): a loop whose client was dropped without close() (the last
    reference gone, the thread still running) is otherwise a daemon thread inside uvloop while the interpreter
    finalises, which crashed exits (SIGSEGV after pytest's summary, a process that had torch imported)."""
    with _running_lock:
        left = list(_running)
    for lt in left:
        try:
            lt.stop()
        except Exception:  # exiting anyway
            pass
