"""locks.outlast: a cancelled task that waits on work in a thread keeps what it holds until the work ends.

The storage service runs chunk-engine calls in disk threads under a per-chunk lock; a request's task
cancelled meanwhile (deadline, closed connection) used to let go of the lock while the call still ran."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from threefs.common.locks import KeyedLocks, outlast


def test_cancelled_task_holds_its_lock_until_the_thread_returns():
    async def main():
        locks = KeyedLocks()
        started, release = threading.Event(), threading.Event()
        finished = []

        def engine_call():
            started.set()
            assert release.wait(30)
            finished.append(True)
            return 7

        async def request():
            async with locks.hold("chunk"):
                return await outlast(loop.run_in_executor(pool, engine_call))

        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            task = asyncio.create_task(request())
            while not started.is_set():
                await asyncio.sleep(0.001)
            task.cancel()
            for _ in range(50):  # the loop runs on; the task must not end, the lock must stay held
                await asyncio.sleep(0)
            assert not task.done()
            assert len(locks) == 1
            task.cancel()  # cancelled again: still waits
            for _ in range(20):
                await asyncio.sleep(0)
            assert not task.done()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert finished == [True]
            assert len(locks) == 0  # released only now

    asyncio.run(main())


def test_results_and_errors_pass_through():
    async def main():
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            assert await outlast(loop.run_in_executor(pool, lambda: 5)) == 5

            def fail():
                raise ValueError("disk")

            with pytest.raises(ValueError, match="disk"):
                await outlast(loop.run_in_executor(pool, fail))

    asyncio.run(main())


def test_a_timeout_around_it_still_fires_once_the_work_ends():
    async def main():
        loop = asyncio.get_running_loop()
        release = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            fut = loop.run_in_executor(pool, lambda: release.wait(30))
            loop.call_later(0.05, release.set)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.01):
                    await outlast(fut)
            assert fut.done()

    asyncio.run(main())
