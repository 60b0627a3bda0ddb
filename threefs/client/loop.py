"""A private event loop in a background thread, so the synchronous API can drive asyncio code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a hard dependency, this keeps imports working
    uvloop = None


class LoopThread:
    def __init__(self, name: str = "threefs-client"):
        self.loop = uvloop.new_event_loop() if uvloop else asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
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
